package datatype

import "unsafe"

// The copy engine. user is the memory the type describes (the origin of an
// element is at user + org), packed is the contiguous stream at packed +
// pos. Pointers are only ever formed to bytes that are copied, never one past
// the end of a region, so the engine is valid for Go memory (checkptr) and for
// memory from C or a device mapping alike.

type engine struct {
	user   unsafe.Pointer
	packed unsafe.Pointer
	pos    int64
	unpack bool
}

func (e *engine) copyRun(at, n int64) {
	u := unsafe.Slice((*byte)(unsafe.Add(e.user, at)), n)
	p := unsafe.Slice((*byte)(unsafe.Add(e.packed, e.pos)), n)
	if e.unpack {
		copy(u, p)
	} else {
		copy(p, u)
	}
	e.pos += n
}

// strided moves n blocks of l bytes, the i-th at user offset at + i*stride.
func (e *engine) strided(at, n, stride, l int64) {
	if n == 1 || stride == l {
		e.copyRun(at, n*l)
		return
	}
	if e.unpack {
		switch l {
		case 1:
			scatter[[1]byte](e, at, n, stride)
		case 2:
			scatter[[2]byte](e, at, n, stride)
		case 4:
			scatter[[4]byte](e, at, n, stride)
		case 8:
			scatter[[8]byte](e, at, n, stride)
		case 12:
			scatter[[12]byte](e, at, n, stride)
		case 16:
			scatter[[16]byte](e, at, n, stride)
		case 24:
			scatter[[24]byte](e, at, n, stride)
		case 32:
			scatter[[32]byte](e, at, n, stride)
		case 48:
			scatter[[48]byte](e, at, n, stride)
		case 64:
			scatter[[64]byte](e, at, n, stride)
		default:
			for i := int64(0); i < n; i++ {
				e.copyRun(at+i*stride, l)
			}
			return
		}
	} else {
		switch l {
		case 1:
			gather[[1]byte](e, at, n, stride)
		case 2:
			gather[[2]byte](e, at, n, stride)
		case 4:
			gather[[4]byte](e, at, n, stride)
		case 8:
			gather[[8]byte](e, at, n, stride)
		case 12:
			gather[[12]byte](e, at, n, stride)
		case 16:
			gather[[16]byte](e, at, n, stride)
		case 24:
			gather[[24]byte](e, at, n, stride)
		case 32:
			gather[[32]byte](e, at, n, stride)
		case 48:
			gather[[48]byte](e, at, n, stride)
		case 64:
			gather[[64]byte](e, at, n, stride)
		default:
			for i := int64(0); i < n; i++ {
				e.copyRun(at+i*stride, l)
			}
			return
		}
	}
	e.pos += n * l
}

// gather and scatter are instantiated once per block size: each is a loop
// of fixed-size moves the compiler turns into a few register loads/stores.
func gather[B any](e *engine, at, n, stride int64) {
	var z B
	l := int64(unsafe.Sizeof(z))
	u, p, pos := e.user, e.packed, e.pos
	for i := int64(0); i < n; i++ {
		*(*B)(unsafe.Add(p, pos+i*l)) = *(*B)(unsafe.Add(u, at+i*stride))
	}
}

func scatter[B any](e *engine, at, n, stride int64) {
	var z B
	l := int64(unsafe.Sizeof(z))
	u, p, pos := e.user, e.packed, e.pos
	for i := int64(0); i < n; i++ {
		*(*B)(unsafe.Add(u, at+i*stride)) = *(*B)(unsafe.Add(p, pos+i*l))
	}
}

// leaves moves the leaf entries ents of a list at origin org.
func (e *engine) leaves(org int64, ents []entry) {
	if len(ents) == 0 {
		return
	}
	l := ents[0].len
	uniform := l <= 64
	for i := range ents {
		if ents[i].len != l {
			uniform = false
			break
		}
	}
	if uniform {
		switch l {
		case 8:
			listMove[[8]byte](e, org, ents)
			return
		case 16:
			listMove[[16]byte](e, org, ents)
			return
		case 24:
			listMove[[24]byte](e, org, ents)
			return
		case 4:
			listMove[[4]byte](e, org, ents)
			return
		case 32:
			listMove[[32]byte](e, org, ents)
			return
		}
	}
	for i := range ents {
		e.copyRun(org+ents[i].disp, ents[i].len)
	}
}

func listMove[B any](e *engine, org int64, ents []entry) {
	var z B
	l := int64(unsafe.Sizeof(z))
	u, p, pos := e.user, e.packed, e.pos
	if e.unpack {
		for i := range ents {
			*(*B)(unsafe.Add(u, org+ents[i].disp)) = *(*B)(unsafe.Add(p, pos+int64(i)*l))
		}
	} else {
		for i := range ents {
			*(*B)(unsafe.Add(p, pos+int64(i)*l)) = *(*B)(unsafe.Add(u, org+ents[i].disp))
		}
	}
	e.pos += int64(len(ents)) * l
}

// exec moves reps complete executions of nd, the k-th at origin
// org + k*rstride.
func (e *engine) exec(nd *node, org, reps, rstride int64) {
	switch nd.op {
	case opLeaf:
		e.strided(org+nd.off, reps, rstride, nd.length)
	case opLoop:
		c := nd.child
		for k := int64(0); k < reps; k++ {
			e.exec(c, org+nd.off+k*rstride, nd.n, nd.stride)
		}
	case opList:
		for k := int64(0); k < reps; k++ {
			o := org + nd.off + k*rstride
			if nd.leafs {
				e.leaves(o, nd.ents)
				continue
			}
			for i := range nd.ents {
				en := &nd.ents[i]
				if en.nd == nil {
					e.copyRun(o+en.disp, en.len)
				} else {
					e.exec(en.nd, o+en.disp, 1, 0)
				}
			}
		}
	}
}

// run moves packed bytes [skip, skip+want) of one execution of nd at org;
// 0 < want and skip+want <= nd.size.
func (e *engine) run(nd *node, org, skip, want int64) {
	if skip == 0 && want == nd.size {
		e.exec(nd, org, 1, 0)
		return
	}
	org += nd.off
	switch nd.op {
	case opLeaf:
		e.copyRun(org+skip, want)
	case opLoop:
		c := nd.child
		cs := c.size
		i, r := skip/cs, skip%cs
		if r != 0 {
			t := min(cs-r, want)
			e.run(c, org+i*nd.stride, r, t)
			want -= t
			i++
		}
		if f := want / cs; f > 0 {
			e.exec(c, org+i*nd.stride, f, nd.stride)
			i += f
			want -= f * cs
		}
		if want > 0 {
			e.run(c, org+i*nd.stride, 0, want)
		}
	case opList:
		i := nd.entryAt(skip)
		r := skip - nd.prefix[i]
		for want > 0 {
			en := &nd.ents[i]
			t := min(en.len-r, want)
			if en.nd == nil {
				e.copyRun(org+en.disp+r, t)
			} else {
				e.run(en.nd, org+en.disp, r, t)
			}
			want -= t
			r = 0
			i++
		}
	}
}
