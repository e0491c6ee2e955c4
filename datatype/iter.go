package datatype

import "iter"

// Segment is a run of Len contiguous data bytes at byte offset Off from the
// buffer origin.
type Segment struct {
	Off int64
	Len int64
}

// walk yields the pieces of packed bytes [skip, skip+want) of one execution
// of nd at org, in order; it stops early when yield returns false.
func walk(nd *node, org, skip, want int64, yield func(off, n int64) bool) bool {
	org += nd.off
	switch nd.op {
	case opLeaf:
		return yield(org+skip, want)
	case opLoop:
		c := nd.child
		cs := c.size
		for i := skip / cs; want > 0; i++ {
			r := skip % cs
			skip = 0
			t := min(cs-r, want)
			if c.op == opLeaf {
				if !yield(org+i*nd.stride+c.off+r, t) {
					return false
				}
			} else if !walk(c, org+i*nd.stride, r, t, yield) {
				return false
			}
			want -= t
		}
	case opList:
		i := nd.entryAt(skip)
		r := skip - nd.start(i)
		if nd.ulen > 0 {
			for d := nd.disp(i); ; {
				t := min(nd.ulen-r, want)
				if !yield(org+d+r, t) {
					return false
				}
				if want -= t; want == 0 {
					return true
				}
				r = 0
				i++
				d = nd.nextDisp(i, d)
			}
		}
		for ; want > 0; i++ {
			en := nd.ents[i] // not uniform: those returned above
			t := min(en.len-r, want)
			if en.nd == nil {
				if !yield(org+en.disp+r, t) {
					return false
				}
			} else if !walk(en.nd, org+en.disp, r, t, yield) {
				return false
			}
			want -= t
			r = 0
		}
	}
	return true
}

// segments yields merged segments of packed bytes [from, from+want).
func segments(nd *node, from, want int64, yield func(Segment) bool) {
	if nd == nil || want <= 0 {
		return
	}
	var cur Segment
	ok := walk(nd, 0, from, want, func(off, n int64) bool {
		if cur.Len > 0 && cur.Off+cur.Len == off {
			cur.Len += n
			return true
		}
		if cur.Len > 0 && !yield(cur) {
			return false
		}
		cur = Segment{off, n}
		return true
	})
	if ok && cur.Len > 0 {
		yield(cur)
	}
}

// Segments returns an iterator over the data segments, in typemap order, of
// the packed bytes [offset, offset+length) of count elements of t; length is
// clipped at the end of the stream and a negative length means "to the end".
// Adjacent segments are merged; the first and last segment may be parts of
// blocks. Offsets are relative to the buffer origin.
func (t *Type) Segments(count, offset, length int64) (iter.Seq[Segment], error) {
	nd, err := t.program(count)
	if err != nil {
		return nil, err
	}
	var total int64
	if nd != nil {
		total = nd.size
	}
	if offset < 0 || offset > total {
		return nil, invalid("Segments: packed offset %d outside [0, %d]", offset, total)
	}
	if length < 0 || length > total-offset {
		length = total - offset
	}
	return func(yield func(Segment) bool) { segments(nd, offset, length, yield) }, nil
}

// Typemap returns the data of count elements of t as merged (offset, length)
// segments in typemap order. It materialises every segment; use Segments or
// an Iterator for huge types.
func (t *Type) Typemap(count int64) ([]Segment, error) {
	seq, err := t.Segments(count, 0, -1)
	if err != nil {
		return nil, err
	}
	var out []Segment
	for s := range seq {
		out = append(out, s)
	}
	return out, nil
}

// Iterator walks the packed stream of count elements of a type in chunks,
// like an MPI convertor: each call to Next returns the segments of the next
// piece of the stream, bounded in bytes and in number of segments (for
// example the maximum IOV entries of one network operation). An Iterator is
// not safe for concurrent use; create one per transfer.
type Iterator struct {
	nd    *node
	total int64
	pos   int64
}

// NewIterator returns an iterator at packed offset 0 of count elements of t.
func (t *Type) NewIterator(count int64) (*Iterator, error) {
	nd, err := t.program(count)
	if err != nil {
		return nil, err
	}
	it := &Iterator{nd: nd}
	if nd != nil {
		it.total = nd.size
	}
	return it, nil
}

// Pos returns the current packed offset.
func (it *Iterator) Pos() int64 { return it.pos }

// Total returns the packed size of the whole stream.
func (it *Iterator) Total() int64 { return it.total }

// Done reports whether the whole stream has been returned.
func (it *Iterator) Done() bool { return it.pos >= it.total }

// SetPos moves to packed offset pos, in [0, Total()].
func (it *Iterator) SetPos(pos int64) error {
	if pos < 0 || pos > it.total {
		return invalid("Iterator.SetPos: offset %d outside [0, %d]", pos, it.total)
	}
	it.pos = pos
	return nil
}

// Next fills buf with the merged segments of the next at most maxBytes bytes
// of the stream, using at most len(buf) segments, advances the position by
// the bytes returned and returns buf[:k] and that byte count. It returns no
// segments at the end of the stream or when buf is empty or maxBytes <= 0.
func (it *Iterator) Next(buf []Segment, maxBytes int64) ([]Segment, int64) {
	want := min(maxBytes, it.total-it.pos)
	if want <= 0 || len(buf) == 0 {
		return buf[:0], 0
	}
	k := 0
	var got int64
	segments(it.nd, it.pos, want, func(s Segment) bool {
		if k == len(buf) {
			return false
		}
		buf[k] = s
		k++
		got += s.Len
		return true
	})
	it.pos += got
	return buf[:k], got
}
