package datatype

import "unsafe"

// Region is a raw memory region [Ptr, Ptr+Len): host memory from C or a
// mapping, or a device buffer visible to the CPU. The caller guarantees that
// the memory is valid for the duration of the call.
type Region struct {
	Ptr unsafe.Pointer
	Len int64
}

// SliceRegion returns the region of a byte slice.
func SliceRegion(b []byte) Region {
	return Region{Ptr: unsafe.Pointer(unsafe.SliceData(b)), Len: int64(len(b))}
}

// countProg caches the program of count elements (one loop over the root).
type countProg struct {
	count int64
	nd    *node
}

// program returns the compiled program of count elements of t, or nil when
// there is no data.
func (t *Type) program(count int64) (*node, error) {
	if err := usable(t, "type"); err != nil {
		return nil, err
	}
	if count < 0 {
		return nil, invalid("negative count %d", count)
	}
	if t.root == nil || count == 0 {
		return nil, nil
	}
	if count == 1 {
		return t.root, nil
	}
	if p := t.last.Load(); p != nil && p.count == count {
		return p.nd, nil
	}
	var a arith
	nd := repeat(t.root, count, t.Extent(), &a)
	if nd != nil {
		a.sub(nd.hi, nd.lo, "true extent")
	}
	if err := a.err(); err != nil {
		return nil, err
	}
	t.last.Store(&countProg{count, nd})
	return nd, nil
}

// PackedSize returns the number of bytes count elements of t pack into:
// count * Size (MPI_Pack_size without the implementation header).
func (t *Type) PackedSize(count int64) (int64, error) {
	if err := usable(t, "type"); err != nil {
		return 0, err
	}
	if count < 0 {
		return 0, invalid("PackedSize: negative count %d", count)
	}
	var a arith
	n := a.mul(count, t.size, "PackedSize")
	return n, a.err()
}

// checkUser verifies that the data of the program at origin base lie inside
// a user region of n bytes.
func checkUser(nd *node, base, n int64, what string) error {
	if base < 0 || base > n {
		return invalid("%s: base %d outside buffer of %d bytes", what, base, n)
	}
	if nd == nil {
		return nil
	}
	var a arith
	lo := a.add(base, nd.lo, "data bounds")
	hi := a.add(base, nd.hi, "data bounds")
	if err := a.err(); err != nil {
		return err
	}
	if lo < 0 || hi > n {
		return invalid("%s: data at [%d, %d) relative to base %d outside buffer of %d bytes",
			what, nd.lo, nd.hi, base, n)
	}
	return nil
}

// move is the common body of all pack and unpack calls.
func (t *Type) move(user, packed Region, base, count, offset int64, unpack bool, what string) (int64, error) {
	nd, n, err := t.prepare(user, packed, base, count, offset, what)
	if err != nil || n == 0 {
		return 0, err
	}
	e := engine{user: user.Ptr, packed: packed.Ptr, unpack: unpack}
	e.run(nd, base, offset, n)
	return n, nil
}

// prepare checks the arguments of a move and returns the program and the
// number of packed bytes to move from offset.
func (t *Type) prepare(user, packed Region, base, count, offset int64, what string) (*node, int64, error) {
	nd, err := t.program(count)
	if err != nil {
		return nil, 0, err
	}
	if user.Len < 0 || packed.Len < 0 {
		return nil, 0, invalid("%s: negative region length", what)
	}
	if err := checkUser(nd, base, user.Len, what); err != nil {
		return nil, 0, err
	}
	var total int64
	if nd != nil {
		total = nd.size
	}
	if offset < 0 || offset > total {
		return nil, 0, invalid("%s: packed offset %d outside [0, %d]", what, offset, total)
	}
	n := min(packed.Len, total-offset)
	if n == 0 {
		return nil, 0, nil
	}
	if (user.Ptr == nil) || (packed.Ptr == nil) {
		return nil, 0, invalid("%s: nil region pointer", what)
	}
	return nd, n, nil
}

// Pack packs count elements of t whose origin is src[base] into dst and
// returns the number of bytes written, count*Size. dst must hold them all.
func (t *Type) Pack(dst, src []byte, base, count int64) (int64, error) {
	total, err := t.PackedSize(count)
	if err != nil {
		return 0, err
	}
	if int64(len(dst)) < total {
		return 0, invalid("Pack: destination of %d bytes, need %d", len(dst), total)
	}
	return t.move(SliceRegion(src), SliceRegion(dst), base, count, 0, false, "Pack")
}

// Unpack unpacks count elements of t from src into dst, whose element origin
// is dst[base], and returns the number of bytes consumed. Bytes of dst not
// covered by the typemap are left untouched.
func (t *Type) Unpack(dst, src []byte, base, count int64) (int64, error) {
	total, err := t.PackedSize(count)
	if err != nil {
		return 0, err
	}
	if int64(len(src)) < total {
		return 0, invalid("Unpack: source of %d bytes, need %d", len(src), total)
	}
	return t.move(SliceRegion(dst), SliceRegion(src), base, count, 0, true, "Unpack")
}

// PackRange packs the bytes [offset, offset+len(dst)) of the packed stream of
// count elements of t (origin src[base]) into dst, clipped at the end of the
// stream, and returns the number of bytes written. Successive calls with
// increasing offsets produce the stream piece by piece, like an MPI
// convertor.
func (t *Type) PackRange(dst, src []byte, base, count, offset int64) (int64, error) {
	return t.move(SliceRegion(src), SliceRegion(dst), base, count, offset, false, "PackRange")
}

// UnpackRange unpacks src as the bytes [offset, offset+len(src)) of the
// packed stream of count elements of t into dst (origin dst[base]), clipped
// at the end of the stream, and returns the number of bytes consumed.
func (t *Type) UnpackRange(dst, src []byte, base, count, offset int64) (int64, error) {
	return t.move(SliceRegion(dst), SliceRegion(src), base, count, offset, true, "UnpackRange")
}

// PackRaw packs bytes [offset, offset+dst.Len) of the packed stream of count
// elements of t, whose origin is at src.Ptr+base, into dst (clipped at the
// end of the stream) and returns the number of bytes written. The data must
// lie inside src.
func (t *Type) PackRaw(dst, src Region, base, count, offset int64) (int64, error) {
	return t.move(src, dst, base, count, offset, false, "PackRaw")
}

// UnpackRaw unpacks src as the bytes [offset, offset+src.Len) of the packed
// stream of count elements of t into dst, whose origin is at dst.Ptr+base,
// clipped at the end of the stream, and returns the number of bytes consumed.
func (t *Type) UnpackRaw(dst, src Region, base, count, offset int64) (int64, error) {
	return t.move(dst, src, base, count, offset, true, "UnpackRaw")
}
