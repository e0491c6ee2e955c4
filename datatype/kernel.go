package datatype

import "unsafe"

// The copy engine. user is the memory the type describes (the origin of an
// element is at user + org), packed is the contiguous stream at packed +
// pos. Pointers are only ever formed to bytes that are copied, never one past
// the end of a region, so the engine is valid for Go memory (checkptr) and for
// memory from C or a device mapping alike.

// Fixed-size word types: assignments of these compile to inline register
// moves (byte arrays would go through memmove).
type (
	w12 struct{ a, b, c uint32 }
	w16 struct{ a, b uint64 }
	w24 struct{ a, b, c uint64 }
	w32 struct{ a, b, c, d uint64 }
	w40 struct{ a, b, c, d, e uint64 }
	w48 struct{ a, b, c, d, e, f uint64 }
	w56 struct{ a, b, c, d, e, f, g uint64 }
	w64 struct{ a, b, c, d, e, f, g, h uint64 }
)

// small copies n <= 64 bytes from src to dst (distinct memory) with at most
// four overlapping word moves.
func small(dst, src unsafe.Pointer, n int64) {
	switch {
	case n >= 32:
		a, b := *(*w32)(src), *(*w32)(unsafe.Add(src, n-32))
		*(*w32)(dst), *(*w32)(unsafe.Add(dst, n-32)) = a, b
	case n >= 16:
		a, b := *(*w16)(src), *(*w16)(unsafe.Add(src, n-16))
		*(*w16)(dst), *(*w16)(unsafe.Add(dst, n-16)) = a, b
	case n >= 8:
		a, b := *(*uint64)(src), *(*uint64)(unsafe.Add(src, n-8))
		*(*uint64)(dst), *(*uint64)(unsafe.Add(dst, n-8)) = a, b
	case n >= 4:
		a, b := *(*uint32)(src), *(*uint32)(unsafe.Add(src, n-4))
		*(*uint32)(dst), *(*uint32)(unsafe.Add(dst, n-4)) = a, b
	default:
		for i := int64(0); i < n; i++ {
			*(*byte)(unsafe.Add(dst, i)) = *(*byte)(unsafe.Add(src, i))
		}
	}
}

type engine struct {
	user   unsafe.Pointer
	packed unsafe.Pointer
	pos    int64
	unpack bool
}

func (e *engine) copyRun(at, n int64) {
	if n <= 64 {
		if e.unpack {
			small(unsafe.Add(e.user, at), unsafe.Add(e.packed, e.pos), n)
		} else {
			small(unsafe.Add(e.packed, e.pos), unsafe.Add(e.user, at), n)
		}
		e.pos += n
		return
	}
	if rep := repBlock(n); rep || hasBlockKernel && n <= blockKernelMax {
		e.blocks(at, 1, 0, n, rep)
		return
	}
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
			scatter[uint8](e, at, n, stride)
		case 2:
			scatter[uint16](e, at, n, stride)
		case 4:
			scatter[uint32](e, at, n, stride)
		case 8:
			scatter[uint64](e, at, n, stride)
		case 12:
			scatter[w12](e, at, n, stride)
		case 16:
			scatter[w16](e, at, n, stride)
		case 24:
			scatter[w24](e, at, n, stride)
		case 32:
			scatter[w32](e, at, n, stride)
		case 40:
			scatter[w40](e, at, n, stride)
		case 48:
			scatter[w48](e, at, n, stride)
		case 56:
			scatter[w56](e, at, n, stride)
		case 64:
			scatter[w64](e, at, n, stride)
		default:
			e.stridedLarge(at, n, stride, l)
			return
		}
	} else {
		switch l {
		case 1:
			gather[uint8](e, at, n, stride)
		case 2:
			gather[uint16](e, at, n, stride)
		case 4:
			gather[uint32](e, at, n, stride)
		case 8:
			gather[uint64](e, at, n, stride)
		case 12:
			gather[w12](e, at, n, stride)
		case 16:
			gather[w16](e, at, n, stride)
		case 24:
			gather[w24](e, at, n, stride)
		case 32:
			gather[w32](e, at, n, stride)
		case 40:
			gather[w40](e, at, n, stride)
		case 48:
			gather[w48](e, at, n, stride)
		case 56:
			gather[w56](e, at, n, stride)
		case 64:
			gather[w64](e, at, n, stride)
		default:
			e.stridedLarge(at, n, stride, l)
			return
		}
	}
	e.pos += n * l
}

// blockKernelMax is the largest block blocks64 moves; longer runs go to
// memmove, whose large-copy paths (rep movs, non-temporal stores) win there.
const blockKernelMax = 16 << 10

// Blocks of repKernelMin to repKernelMax bytes move with blocksRep (one REP
// MOVSB each) where the CPU has enhanced REP MOVSB. On the Zen 4 VM
// (2026-11-23, blocks at a stride of twice their length, 256 KiB packed)
// it moved 2.5-4 KiB blocks at 67-93 GB/s against the AVX2 kernel's and
// memmove's 54-56, and 16-256 KiB runs at 106-138 against memmove's
// 79-116; at 2 KiB and below it was no faster (56 against 55), and at
// 1 MiB slower than memmove's non-temporal stores (58 against 68).
const (
	repKernelMin = 2560
	repKernelMax = 256 << 10
)

// repBlock says whether blocks of l bytes move with blocksRep.
func repBlock(l int64) bool { return l >= repKernelMin && l <= repKernelMax && repKernel() }

// repFaster says whether blocksRep beats the AVX2 kernel and memmove on a
// CPU (vendor, display family and model, whether it has ERMS). Measured:
// on a Zen 4 VM (family 19h, EPYC Genoa) REP MOVSB moved 2.5-4 KiB blocks
// at 67-93 GB/s against the AVX2 kernel's 54-56 (2026-11-23); on a Zen 3
// VM (family 19h model 01h, EPYC Milan) it was 5-15 % slower than the
// AVX2 kernel from 2.5 to 16 KiB blocks and than memmove at 32 KiB, level
// with memmove at 128 KiB (milc_zd 26 against 32 GB/s, fft 26 against 33, 2026-12-01), as on
// earlier AMD cores, where glibc's memcpy avoids it too. On an Intel Xeon
// VM (family 6 model CFh, Emerald Rapids, 2026-12-06; median of 15
// interleaved rounds, two runs) it was 0-11 % slower than the AVX2 kernel
// at 2.5-4 KiB (5 % in four of six; 34.3 against 36.5 GB/s at 2.5 KiB) and level from 8 KiB
// up, though 15-42 % faster packing nas_mg_y's 4 KiB blocks 1 MB apart (four
// of five comparisons). Against Open MPI over all 13 layouts (make
// bench-mpi) one layout was behind with it off (nas_mg_y, 0.88/0.91) and
// three with it on (nas_mg_y unpack 0.85, nas_mg_z 0.91/0.89, fft
// 0.85/0.90). So AMD CPUs before Zen 4 and that Intel model use the AVX2 kernel;
// Zen 4 and later, and other CPUs with ERMS (unmeasured here), use REP
// MOVSB.
func repFaster(vendor string, family, model uint32, erms bool) bool {
	if !erms {
		return false
	}
	if vendor == "GenuineIntel" {
		return !(family == 0x6 && model == 0xcf) // Emerald Rapids: measured slower
	}
	if vendor != "AuthenticAMD" && vendor != "HygonGenuine" { // Hygon's Dhyana is a Zen core
		return true
	}
	switch {
	case family < 0x19:
		return false // Zen, Zen 2 and older
	case family > 0x19:
		return true // Zen 5 and later
	}
	// Family 19h is Zen 3 and Zen 4; these model ranges are Zen 4.
	return model >= 0x10 && model <= 0x1f || model >= 0x60 && model <= 0x7f || model >= 0xa0 && model <= 0xaf
}

// RepKernel reports whether packs and unpacks move blocks of 2.5 to 256 KiB
// with REP MOVSB (docs/datatype.md); otherwise the AVX2 kernel or memmove
// moves them.
func RepKernel() bool { return repKernel() }

// SetRepKernel turns the REP MOVSB kernel on or off for packs and unpacks
// started afterwards, and returns whether it is on: it can be only on amd64
// CPUs with enhanced REP MOVSB. The default depends on the CPU (on where it
// was measured to be faster); the setting is for benchmarks and for CPUs
// the default misjudges. Results are the same bytes either way.
func SetRepKernel(on bool) bool { return setRepKernel(on) }

// stridedLarge moves n blocks of l bytes for the sizes gather has no
// instance for: the assembly kernel above 64 bytes, copyRun otherwise.
func (e *engine) stridedLarge(at, n, stride, l int64) {
	if rep := repBlock(l); rep || hasBlockKernel && l > 64 && l <= blockKernelMax {
		e.blocks(at, n, stride, l, rep)
		return
	}
	for i := int64(0); i < n; i++ {
		e.copyRun(at+i*stride, l)
	}
}

// blocks moves n blocks of l bytes with an assembly kernel, the i-th at
// user offset at + i*stride, and advances pos: blocksRep when rep (the
// caller's repBlock(l), read once: SetRepKernel may change it meanwhile,
// and blocks64 must not get a block it cannot move, on a CPU it may not
// run on), else blocks64 (which needs 64 < l <= blockKernelMax).
func (e *engine) blocks(at, n, stride, l int64, rep bool) {
	u, p := unsafe.Add(e.user, at), unsafe.Add(e.packed, e.pos)
	dst, src, dstStride, srcStride := p, u, l, stride
	if e.unpack {
		dst, src, dstStride, srcStride = u, p, stride, l
	}
	if rep {
		blocksRep(dst, src, n, l, dstStride, srcStride)
	} else {
		blocks64(dst, src, n, l, dstStride, srcStride)
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

// leaves moves entries [i, i+k) of uniform list nd at origin org, k >= 1:
// every entry when called from exec, a run of whole entries from run.
func (e *engine) leaves(org int64, nd *node, i, k int) {
	if nd.deltas != nil {
		e.deltaLeaves(org+nd.disp(i), nd.ulen, nd.deltas[i+1:i+k])
		return
	}
	disps := nd.disps[i : i+k]
	switch nd.ulen {
	case 4:
		listMove[uint32](e, org, disps)
	case 8:
		listMove[uint64](e, org, disps)
	case 12:
		listMove[w12](e, org, disps)
	case 16:
		listMove[w16](e, org, disps)
	case 24:
		listMove[w24](e, org, disps)
	case 32:
		listMove[w32](e, org, disps)
	case 48:
		listMove[w48](e, org, disps)
	case 64:
		listMove[w64](e, org, disps)
	default:
		for _, d := range disps {
			e.copyRun(org+d, nd.ulen)
		}
	}
}

// deltaLeaves moves the entries of a delta-coded list: the first at user
// offset at, each next one steps[j] bytes after the one before.
func (e *engine) deltaLeaves(at, l int64, steps []uint16) {
	switch l {
	case 4:
		deltaMove[uint32](e, at, steps)
	case 8:
		deltaMove[uint64](e, at, steps)
	case 12:
		deltaMove[w12](e, at, steps)
	case 16:
		deltaMove[w16](e, at, steps)
	case 24:
		deltaMove[w24](e, at, steps)
	case 32:
		deltaMove[w32](e, at, steps)
	case 48:
		deltaMove[w48](e, at, steps)
	case 64:
		deltaMove[w64](e, at, steps)
	default:
		e.copyRun(at, l)
		for _, d := range steps {
			at += int64(d)
			e.copyRun(at, l)
		}
	}
}

// tile moves reps executions of a loop of n blocks of L bytes (user
// stride stride) whose executions are rstride apart, four executions at a
// time: the four blocks at one loop index share cache lines when rstride is
// small, and the large stride would otherwise evict them (transposes).
func (e *engine) tile(at, n, stride, reps, rstride, l int64) bool {
	if reps < 4 || rstride <= 0 || rstride > 64 || stride < 256 || stride < 4*rstride {
		return false
	}
	switch l {
	case 4:
		tile4[uint32](e, at, n, stride, reps, rstride)
	case 8:
		tile4[uint64](e, at, n, stride, reps, rstride)
	case 16:
		tile4[w16](e, at, n, stride, reps, rstride)
	default:
		return false
	}
	return true
}

func tile4[B any](e *engine, at, n, stride, reps, rstride int64) {
	var z B
	l := int64(unsafe.Sizeof(z))
	u, p := e.user, e.packed
	pn := n * l
	k := int64(0)
	for ; k+4 <= reps; k += 4 {
		a, pos := at+k*rstride, e.pos+k*pn
		if e.unpack {
			for i := int64(0); i < n; i++ {
				s, d := a+i*stride, pos+i*l
				*(*B)(unsafe.Add(u, s)) = *(*B)(unsafe.Add(p, d))
				*(*B)(unsafe.Add(u, s+rstride)) = *(*B)(unsafe.Add(p, d+pn))
				*(*B)(unsafe.Add(u, s+2*rstride)) = *(*B)(unsafe.Add(p, d+2*pn))
				*(*B)(unsafe.Add(u, s+3*rstride)) = *(*B)(unsafe.Add(p, d+3*pn))
			}
		} else {
			for i := int64(0); i < n; i++ {
				s, d := a+i*stride, pos+i*l
				*(*B)(unsafe.Add(p, d)) = *(*B)(unsafe.Add(u, s))
				*(*B)(unsafe.Add(p, d+pn)) = *(*B)(unsafe.Add(u, s+rstride))
				*(*B)(unsafe.Add(p, d+2*pn)) = *(*B)(unsafe.Add(u, s+2*rstride))
				*(*B)(unsafe.Add(p, d+3*pn)) = *(*B)(unsafe.Add(u, s+3*rstride))
			}
		}
	}
	e.pos += k * pn
	for ; k < reps; k++ {
		e.strided(at+k*rstride, n, stride, l)
	}
}

func listMove[B any](e *engine, org int64, disps []int64) {
	var z B
	l := int64(unsafe.Sizeof(z))
	u, p, pos := e.user, e.packed, e.pos
	i := 0
	if e.unpack {
		for ; i+4 <= len(disps); i += 4 {
			d := disps[i : i+4 : i+4]
			q := pos + int64(i)*l
			*(*B)(unsafe.Add(u, org+d[0])) = *(*B)(unsafe.Add(p, q))
			*(*B)(unsafe.Add(u, org+d[1])) = *(*B)(unsafe.Add(p, q+l))
			*(*B)(unsafe.Add(u, org+d[2])) = *(*B)(unsafe.Add(p, q+2*l))
			*(*B)(unsafe.Add(u, org+d[3])) = *(*B)(unsafe.Add(p, q+3*l))
		}
		for ; i < len(disps); i++ {
			*(*B)(unsafe.Add(u, org+disps[i])) = *(*B)(unsafe.Add(p, pos+int64(i)*l))
		}
	} else {
		for ; i+4 <= len(disps); i += 4 {
			d := disps[i : i+4 : i+4]
			q := pos + int64(i)*l
			*(*B)(unsafe.Add(p, q)) = *(*B)(unsafe.Add(u, org+d[0]))
			*(*B)(unsafe.Add(p, q+l)) = *(*B)(unsafe.Add(u, org+d[1]))
			*(*B)(unsafe.Add(p, q+2*l)) = *(*B)(unsafe.Add(u, org+d[2]))
			*(*B)(unsafe.Add(p, q+3*l)) = *(*B)(unsafe.Add(u, org+d[3]))
		}
		for ; i < len(disps); i++ {
			*(*B)(unsafe.Add(p, pos+int64(i)*l)) = *(*B)(unsafe.Add(u, org+disps[i]))
		}
	}
	e.pos += int64(len(disps)) * l
}

// exec moves reps complete executions of nd, the k-th at origin
// org + k*rstride.
func (e *engine) exec(nd *node, org, reps, rstride int64) {
	switch nd.op {
	case opLeaf:
		e.strided(org+nd.off, reps, rstride, nd.length)
	case opLoop:
		c := nd.child
		if c.op == opLeaf && reps > 1 && e.tile(org+nd.off+c.off, nd.n, nd.stride, reps, rstride, c.length) {
			return
		}
		for k := int64(0); k < reps; k++ {
			e.exec(c, org+nd.off+k*rstride, nd.n, nd.stride)
		}
	case opList:
		for k := int64(0); k < reps; k++ {
			o := org + nd.off + k*rstride
			if nd.ulen > 0 {
				e.leaves(o, nd, 0, nd.entries())
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
		r := skip - nd.start(i)
		if nd.ulen > 0 {
			e.runUniform(nd, org, i, r, want)
			return
		}
		for want > 0 {
			en := nd.ents[i] // not uniform: those returned above
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

// runUniform moves want packed bytes of uniform list nd at org, starting r
// bytes into entry i: a partial first entry, the whole entries in between
// with the list kernels (as exec does), a partial last entry.
func (e *engine) runUniform(nd *node, org int64, i int, r, want int64) {
	l := nd.ulen
	if r > 0 {
		t := min(l-r, want)
		e.copyRun(org+nd.disp(i)+r, t)
		want -= t
		i++
	}
	if k := int(want / l); k > 0 {
		e.leaves(org, nd, i, k)
		i += k
		want -= int64(k) * l
	}
	if want > 0 {
		e.copyRun(org+nd.disp(i), want)
	}
}

func deltaMove[B any](e *engine, at int64, steps []uint16) {
	var z B
	l := int64(unsafe.Sizeof(z))
	u, p, pos := e.user, e.packed, e.pos
	if e.unpack {
		*(*B)(unsafe.Add(u, at)) = *(*B)(unsafe.Add(p, pos))
		for _, d := range steps {
			at += int64(d)
			pos += l
			*(*B)(unsafe.Add(u, at)) = *(*B)(unsafe.Add(p, pos))
		}
	} else {
		*(*B)(unsafe.Add(p, pos)) = *(*B)(unsafe.Add(u, at))
		for _, d := range steps {
			at += int64(d)
			pos += l
			*(*B)(unsafe.Add(p, pos)) = *(*B)(unsafe.Add(u, at))
		}
	}
	e.pos = pos + l
}
