// Package gpupack packs and unpacks MPI derived datatypes (package
// datatype) whose data lies in GPU memory, in stream order: the GPU pack and
// unpack kernels of DESIGN section 7.
//
// A Packer belongs to one device. Pack enqueues on a stream the packing of
// count elements of a datatype, whose origin is at byte base of a user
// buffer, into a packed buffer; Unpack enqueues the reverse. Both return at
// once, like a kernel launch; the bytes are there once the stream has run
// the work (Stream.Synchronize, an event). The packed stream is exactly the
// one datatype.Type.Pack produces on host memory, so a GPU-packed buffer can
// be unpacked on the host with another layout of the same type signature,
// and the other way round.
//
// What runs where:
//   - host backend: a Go kernel (gpu.LaunchHost) running datatype's own
//     Pack and Unpack on the buffers' memory;
//   - cuda backend: the device code of kernels.cu, embedded as PTX. A layout
//     of equal blocks at a fixed stride (vectors, rows of a subarray) runs
//     one kernel from its parameters; any other layout is flattened once into
//     a table of segments, uploaded to the device and cached per (type,
//     count), and a second kernel walks the table.
//
// Both check the buffers against the layout before anything is enqueued:
// a user buffer that does not hold every byte the layout touches, a packed
// buffer shorter than the packed size, buffers of another system or in Go
// memory, or a freed type give an error wrapping ErrInvalid (or the gpu or
// datatype error underneath), and nothing is enqueued.
package gpupack

import (
	"container/list"
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"sync"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

// kernelsPTX is kernels.cu compiled for the GPU (`make ptx`).
//
//go:embed kernels.ptx
var kernelsPTX []byte

// ErrInvalid: a pack or unpack whose arguments do not fit the layout or the
// device (the error says which).
var ErrInvalid = errors.New("gpupack: invalid argument")

// ErrTooManySegments: a layout that is not a regular vector has more
// segments than Options.MaxSegments, so its table is not built.
var ErrTooManySegments = errors.New("gpupack: layout has too many segments for a device table")

// Options bound a Packer's tables. Zero fields take the defaults.
type Options struct {
	// MaxSegments is the most segments one layout's device table may have
	// (24 bytes each on the device). Default 1<<22 (96 MiB).
	MaxSegments int64
	// CacheBytes bounds the device memory of all cached tables; the least
	// recently used are freed beyond it. Default 256 MiB.
	CacheBytes int64
}

// Defaults of Options.
const (
	DefaultMaxSegments = 1 << 22
	DefaultCacheBytes  = 256 << 20
)

// segBytes is the size of one table entry: user offset, length, packed
// offset, each an int64.
const segBytes = 24

// Packer packs and unpacks datatypes in the memory of one device. It is safe
// for concurrent use.
type Packer struct {
	dev  *gpu.Device
	opts Options

	// Device code; nil on a backend that runs Go kernels (host).
	mod           *gpu.Module
	vector, table *gpu.Function

	mu     sync.Mutex
	plans  map[planKey]*list.Element // of *plan
	lru    *list.List                // front: most recently used
	bytes  int64                     // device bytes of the cached tables
	stats  Stats
	closed bool
	// inUse counts the plans handed out by plan and not yet given back
	// (unpin): their moves are launching kernels, which read the table and
	// run the module's code. Close waits for it to reach 0 (idle).
	inUse int
	idle  *sync.Cond
}

// Stats counts how a Packer moved layouts.
type Stats struct {
	// GoKernels: moves run as Go kernels (host backend).
	GoKernels int64
	// Vector: moves of regular layouts by the vector kernel.
	Vector int64
	// Table: moves by the table kernel.
	Table int64
	// TablesBuilt: layouts flattened and uploaded (cache misses).
	TablesBuilt int64
	// TablesEvicted: tables freed to stay within Options.CacheBytes.
	TablesEvicted int64
}

type planKey struct {
	t     *datatype.Type
	count int64
}

// plan is how count elements of a type move on the device.
type plan struct {
	key planKey
	// regular: n blocks of blen bytes, stride apart, the first at offset
	// first from the element origin.
	regular                bool
	first, n, blen, stride int64
	table                  gpu.Buffer // nseg entries of segBytes
	pos                    []int64    // each table segment's packed offset, ascending
	nseg                   int64
	group                  int64 // threads per segment of the table kernel
	// users: moves holding the plan (between plan and unpin); evicted:
	// left the cache while held, its table freed by the last unpin.
	users   int
	evicted bool
}

// New returns a Packer for dev, loading the kernels where the backend runs
// device code.
func New(dev *gpu.Device, opts Options) (*Packer, error) {
	if dev == nil {
		return nil, fmt.Errorf("%w: nil device", ErrInvalid)
	}
	if opts.MaxSegments <= 0 {
		opts.MaxSegments = DefaultMaxSegments
	}
	if opts.CacheBytes <= 0 {
		opts.CacheBytes = DefaultCacheBytes
	}
	p := &Packer{dev: dev, opts: opts, plans: map[planKey]*list.Element{}, lru: list.New()}
	p.idle = sync.NewCond(&p.mu)
	goKernels, err := runsGoKernels(dev)
	if err != nil {
		return nil, err
	}
	if goKernels {
		return p, nil
	}
	m, err := dev.LoadModule(kernelsPTX)
	if err != nil {
		return nil, fmt.Errorf("gpupack: the backend of %v runs neither Go kernels nor the pack kernels: %w", dev, err)
	}
	p.mod = m
	if p.vector, err = m.Function("troupe_ddt_vector"); err == nil {
		p.table, err = m.Function("troupe_ddt_table")
	}
	if err != nil {
		_ = m.Unload()
		return nil, err
	}
	return p, nil
}

// runsGoKernels reports whether dev's backend runs gpu.LaunchHost kernels.
func runsGoKernels(dev *gpu.Device) (bool, error) {
	st, err := dev.NewStream()
	if err != nil {
		return false, err
	}
	defer st.Destroy()
	err = gpu.LaunchHost(st, func([][]byte) error { return nil })
	if err == nil {
		err = st.Synchronize()
	}
	if err == nil {
		return true, nil
	}
	if errors.Is(err, gpu.ErrNotSupported) {
		return false, nil
	}
	return false, err
}

// Close frees the cached tables and unloads the kernels; work already
// enqueued finishes first (freeing device memory waits for it).
func (p *Packer) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	for p.inUse > 0 { // moves launching kernels with a plan: the tables and module stay until they are done
		p.idle.Wait()
	}
	var errs []error
	for e := p.lru.Front(); e != nil; e = e.Next() {
		errs = append(errs, p.release(e.Value.(*plan)))
	}
	p.lru.Init()
	clear(p.plans)
	if p.mod != nil {
		errs = append(errs, p.mod.Unload())
	}
	return errors.Join(errs...)
}

// Stats returns the counters so far.
func (p *Packer) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// Pack enqueues on st the packing of count elements of t, whose origin is
// at byte base of user, into packed from its start, and returns the packed
// size. packed must hold at least that many bytes.
func (p *Packer) Pack(st *gpu.Stream, packed, user gpu.Buffer, t *datatype.Type, base, count int64) (int64, error) {
	return p.move(st, user, packed, t, base, count, 0, -1, false)
}

// Unpack enqueues on st the unpacking of the packed stream at the start of
// packed into count elements of t whose origin is at byte base of user, and
// returns the packed size read. Bytes of user outside the layout's blocks
// are left as they are.
func (p *Packer) Unpack(st *gpu.Stream, user, packed gpu.Buffer, t *datatype.Type, base, count int64) (int64, error) {
	return p.move(st, user, packed, t, base, count, 0, -1, true)
}

// PackRange enqueues on st the packing of bytes [off, off+n) of the packed
// stream of count elements of t (origin at byte base of user) into packed
// from its start, and returns n. packed must hold n bytes and the range
// must lie inside the stream. Successive ranges build the stream piece by
// piece, so that a sender can send the first pieces while the next are
// packed.
func (p *Packer) PackRange(st *gpu.Stream, packed, user gpu.Buffer, t *datatype.Type, base, count, off, n int64) (int64, error) {
	if n < 0 {
		return 0, fmt.Errorf("%w: pack range of %d bytes", ErrInvalid, n)
	}
	return p.move(st, user, packed, t, base, count, off, n, false)
}

// UnpackRange enqueues on st the unpacking of packed's first n bytes, as
// bytes [off, off+n) of the packed stream of count elements of t, into the
// layout (origin at byte base of user), and returns n.
func (p *Packer) UnpackRange(st *gpu.Stream, user, packed gpu.Buffer, t *datatype.Type, base, count, off, n int64) (int64, error) {
	if n < 0 {
		return 0, fmt.Errorf("%w: unpack range of %d bytes", ErrInvalid, n)
	}
	return p.move(st, user, packed, t, base, count, off, n, true)
}

// move moves bytes [off, off+n) of the packed stream (n < 0: to its end)
// between the layout and packed.
func (p *Packer) move(st *gpu.Stream, user, packed gpu.Buffer, t *datatype.Type, base, count, off, n int64, unpack bool) (int64, error) {
	op := "pack"
	if unpack {
		op = "unpack"
	}
	size, err := p.check(op, st, user, packed, t, base, count, off, n)
	if err != nil || size == 0 {
		return 0, err
	}
	if n < 0 {
		n = size - off
	}
	if n == 0 {
		return 0, nil
	}
	packed, err = packed.Slice(0, int(n))
	if err != nil {
		return 0, fmt.Errorf("gpupack: %s: %w", op, err)
	}
	if p.mod == nil {
		return n, p.goKernel(st, user, packed, t, base, count, off, unpack)
	}
	pl, err := p.plan(t, count)
	if err != nil {
		return 0, fmt.Errorf("gpupack: %s %d of %v: %w", op, count, t, err)
	}
	defer p.unpin(pl) // once the kernel is launched: it reads the table in stream order
	origin := uint64(user.Ptr()) + uint64(base)
	dir := uint64(0)
	if unpack {
		dir = 1
	}
	if pl.regular {
		words := uint64(0)
		if (origin+uint64(pl.first))%8 == 0 && pl.blen%8 == 0 && pl.stride%8 == 0 && packed.Ptr()%8 == 0 && off%8 == 0 && n%8 == 0 {
			words = 1
		}
		first, units := off, n
		if words == 1 {
			first, units = off/8, n/8
		}
		err = gpu.Launch(st, p.vector, grid(units), gpu.Dim3{X: blockThreads}, args(
			origin+uint64(pl.first), uint64(packed.Ptr()),
			uint64(first), uint64(units), uint64(pl.blen), uint64(pl.stride), words, dir))
		p.count(func(s *Stats) { s.Vector++ })
	} else {
		// The segments that meet [off, off+n): from the one holding off
		// to the last that starts before off+n.
		s0 := sort.Search(len(pl.pos), func(i int) bool { return pl.pos[i] > off }) - 1
		s1 := sort.Search(len(pl.pos), func(i int) bool { return pl.pos[i] >= off+n })
		err = gpu.Launch(st, p.table, grid(int64(s1-s0)*pl.group), gpu.Dim3{X: blockThreads}, args(
			origin, uint64(packed.Ptr()), uint64(pl.table.Ptr())+uint64(s0)*segBytes,
			uint64(s1-s0), uint64(pl.group), dir, uint64(off), uint64(off+n)))
		p.count(func(s *Stats) { s.Table++ })
	}
	if err != nil {
		return 0, fmt.Errorf("gpupack: %s %d of %v: %w", op, count, t, err)
	}
	return n, nil
}

// Check validates count elements of t whose origin is at byte base of user
// as Pack and Unpack would, without enqueueing anything, and returns their
// packed size. A caller that receives into user checks it before the
// message is taken, so that a bad layout loses nothing.
func (p *Packer) Check(user gpu.Buffer, t *datatype.Type, base, count int64) (int64, error) {
	size, _, _, err := p.checkUser("check", user, t, base, count)
	return size, err
}

// check validates a move of bytes [off, off+n) of the packed stream (n < 0:
// to its end) and returns the packed size.
func (p *Packer) check(op string, st *gpu.Stream, user, packed gpu.Buffer, t *datatype.Type, base, count, off, n int64) (int64, error) {
	if st == nil {
		return 0, fmt.Errorf("%w: %s: nil stream", ErrInvalid, op)
	}
	if st.Device() != p.dev {
		return 0, fmt.Errorf("%w: %s: stream of %v, packer of %v", ErrInvalid, op, st.Device(), p.dev)
	}
	size, lo, hi, err := p.checkUser(op, user, t, base, count)
	if err != nil {
		return 0, err
	}
	if n < 0 {
		n = size - off
	}
	if off < 0 || n < 0 || off > size-n {
		return 0, fmt.Errorf("%w: %s %d of %v: bytes [%d, %d) of a %d-byte packed stream", ErrInvalid, op, count, t, off, off+n, size)
	}
	if size == 0 {
		return 0, nil
	}
	if err := p.checkBuffer(op, "packed", packed); err != nil {
		return 0, err
	}
	if int64(packed.Len()) < n {
		return 0, fmt.Errorf("%w: %s %d of %v: packed buffer of %d bytes, %d needed", ErrInvalid, op, count, t, packed.Len(), n)
	}
	if overlap(user, base+lo, base+hi, packed, n) {
		return 0, fmt.Errorf("%w: %s: the packed buffer overlaps the layout's bytes of the user buffer", ErrInvalid, op)
	}
	return size, nil
}

// checkUser validates the user side of a move: the packer, the type and
// count, and the user buffer holding every byte of the layout at base. It
// returns the packed size and the layout's bytes [lo, hi) from the origin.
func (p *Packer) checkUser(op string, user gpu.Buffer, t *datatype.Type, base, count int64) (size, lo, hi int64, err error) {
	if t == nil {
		return 0, 0, 0, fmt.Errorf("%w: %s: nil type", ErrInvalid, op)
	}
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return 0, 0, 0, fmt.Errorf("%w: %s: packer closed", ErrInvalid, op)
	}
	size, err = t.PackedSize(count)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("gpupack: %s %d of %v: %w", op, count, t, err)
	}
	if size == 0 {
		return 0, 0, 0, nil
	}
	lo, hi, err = t.DataBounds(count)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("gpupack: %s %d of %v: %w", op, count, t, err)
	}
	if err := p.checkBuffer(op, "user", user); err != nil {
		return 0, 0, 0, err
	}
	// The origin must lie in user, as datatype and the transport ask: the
	// host backend's kernels are datatype's, which refuse any other, and
	// refused here nothing is enqueued (a negative base whose data fit
	// passed, then failed on the stream).
	if base < 0 || base > int64(user.Len()) || base+lo < 0 || base+hi > int64(user.Len()) {
		return 0, 0, 0, fmt.Errorf("%w: %s %d of %v at base %d touches bytes [%d, %d) of a %d-byte user buffer",
			ErrInvalid, op, count, t, base, base+lo, base+hi, user.Len())
	}
	return size, lo, hi, nil
}

// checkBuffer validates one buffer of a move: live memory of the packer's
// system that its device can reach.
func (p *Packer) checkBuffer(op, name string, b gpu.Buffer) error {
	switch {
	case b.IsZero():
		return fmt.Errorf("%w: %s: zero %s buffer", ErrInvalid, op, name)
	case b.Freed():
		return fmt.Errorf("%w: %s: %s buffer: %w", ErrInvalid, op, name, gpu.ErrFreed)
	case b.System() != p.dev.System():
		return fmt.Errorf("%w: %s: %s buffer %v: %w", ErrInvalid, op, name, b, gpu.ErrForeign)
	case b.Kind() == gpu.KindHost:
		return fmt.Errorf("%w: %s: %s buffer %v is Go memory: %w", ErrInvalid, op, name, b, gpu.ErrUnsupportedKind)
	case b.Kind() == gpu.KindDevice && b.Device() != p.dev:
		return fmt.Errorf("%w: %s: %s buffer on %v, packer of %v", ErrInvalid, op, name, b.Device(), p.dev)
	}
	return nil
}

// overlap reports whether user's bytes [lo, hi) and packed's first n bytes
// share an address.
func overlap(user gpu.Buffer, lo, hi int64, packed gpu.Buffer, n int64) bool {
	u0, p0 := int64(user.Ptr())+lo, int64(packed.Ptr())
	return u0 < p0+n && p0 < int64(user.Ptr())+hi
}

// goKernel enqueues datatype's own pack or unpack of packed's bytes, from
// byte off of the packed stream, as a Go kernel.
func (p *Packer) goKernel(st *gpu.Stream, user, packed gpu.Buffer, t *datatype.Type, base, count, off int64, unpack bool) error {
	p.count(func(s *Stats) { s.GoKernels++ })
	return gpu.LaunchHost(st, func(mem [][]byte) error {
		var err error
		if unpack {
			_, err = t.UnpackRange(mem[0], mem[1], base, count, off)
		} else {
			_, err = t.PackRange(mem[1], mem[0], base, count, off)
		}
		return err
	}, user, packed)
}

func (p *Packer) count(f func(*Stats)) {
	p.mu.Lock()
	f(&p.stats)
	p.mu.Unlock()
}

// plan returns the cached plan of count elements of t, building it on a
// miss, held for the caller until it calls unpin: eviction and Close do not
// free a held plan's table (a kernel launched with it would read freed
// memory). Once the Packer is closed it fails with ErrInvalid: a move that
// passed its checks before a concurrent Close must not cache a table that
// nothing would free any more.
func (p *Packer) plan(t *datatype.Type, count int64) (*plan, error) {
	k := planKey{t, count}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, fmt.Errorf("%w: packer closed", ErrInvalid)
	}
	if e, ok := p.plans[k]; ok {
		p.lru.MoveToFront(e)
		pl := e.Value.(*plan)
		p.pin(pl)
		p.mu.Unlock()
		return pl, nil
	}
	p.mu.Unlock()

	pl, err := p.build(t, count)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed { // closed while it was built
		_ = p.release(pl)
		return nil, fmt.Errorf("%w: packer closed", ErrInvalid)
	}
	if e, ok := p.plans[k]; ok { // built concurrently: keep the first
		p.lru.MoveToFront(e)
		_ = p.release(pl)
		first := e.Value.(*plan)
		p.pin(first)
		return first, nil
	}
	p.plans[k] = p.lru.PushFront(pl)
	p.bytes += pl.nseg * segBytes
	if pl.nseg > 0 {
		p.stats.TablesBuilt++
	}
	// Over the bound: free the least recently used tables, other than
	// this one. Regular plans hold no device memory and stay.
	for e := p.lru.Back(); e != nil && p.bytes > p.opts.CacheBytes; {
		prev := e.Prev()
		if old := e.Value.(*plan); old != pl && old.nseg > 0 {
			p.lru.Remove(e)
			delete(p.plans, old.key)
			p.bytes -= old.nseg * segBytes
			p.stats.TablesEvicted++
			if old.users > 0 {
				old.evicted = true // its last unpin frees it
			} else {
				// Freeing device memory waits for the kernels using it.
				_ = p.release(old)
			}
		}
		e = prev
	}
	p.pin(pl)
	return pl, nil
}

// pin holds pl for a move; the lock is held.
func (p *Packer) pin(pl *plan) {
	pl.users++
	p.inUse++
}

// unpin gives back a plan plan returned, freeing its table if it was
// evicted meanwhile, and wakes a Close waiting for the moves in flight.
func (p *Packer) unpin(pl *plan) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl.users--
	p.inUse--
	if pl.users == 0 && pl.evicted {
		_ = p.release(pl)
	}
	if p.inUse == 0 {
		p.idle.Broadcast()
	}
}

// release frees pl's table, if any.
func (p *Packer) release(pl *plan) error {
	if pl.table.IsZero() {
		return nil
	}
	return gpu.Free(pl.table)
}

// build flattens count elements of t: a regular plan when its segments are
// equal blocks at a fixed stride, else a device table.
func (p *Packer) build(t *datatype.Type, count int64) (*plan, error) {
	segs, err := t.Segments(count, 0, -1)
	if err != nil {
		return nil, err
	}
	pl := &plan{key: planKey{t, count}, regular: true}
	var table []byte
	var total int64
	for s := range segs {
		switch {
		case pl.n == 0:
			pl.first, pl.blen = s.Off, s.Len
		case pl.regular && pl.n == 1 && s.Len == pl.blen:
			pl.stride = s.Off - pl.first
		case pl.regular && s.Len == pl.blen && s.Off == pl.first+pl.n*pl.stride:
		default:
			if pl.regular {
				// Not regular after all: the table starts with the
				// blocks seen so far.
				pl.regular = false
				pl.nseg = pl.n
				for i := int64(0); i < pl.n; i++ {
					table = appendSeg(table, pl.first+i*pl.stride, pl.blen, i*pl.blen)
					pl.pos = append(pl.pos, i*pl.blen)
				}
			}
		}
		if !pl.regular {
			if pl.nseg >= p.opts.MaxSegments {
				return nil, fmt.Errorf("%w: more than %d", ErrTooManySegments, p.opts.MaxSegments)
			}
			table = appendSeg(table, s.Off, s.Len, total)
			pl.pos = append(pl.pos, total)
			pl.nseg++
		}
		total += s.Len
		pl.n++
	}
	if pl.regular {
		if pl.n == 1 {
			pl.stride = pl.blen
		}
		return pl, nil
	}
	pl.group = groupFor(total, pl.nseg)
	buf, err := p.dev.Alloc(len(table))
	if err != nil {
		return nil, err
	}
	if err := gpu.CopyFromHost(buf, table); err != nil {
		_ = gpu.Free(buf)
		return nil, err
	}
	pl.table = buf
	pl.n = 0
	return pl, nil
}

func appendSeg(b []byte, off, n, pos int64) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(off))
	b = binary.LittleEndian.AppendUint64(b, uint64(n))
	return binary.LittleEndian.AppendUint64(b, uint64(pos))
}

// Launch shape. blockThreads threads per block; at most maxBlocks blocks,
// the kernels' grid-stride loops doing the rest.
const (
	blockThreads = 256
	maxBlocks    = 4096
)

// groupFor is how many threads share a segment of a table of nseg segments
// averaging total/nseg bytes: one thread for blocks under 64 bytes, a warp
// under 4 KiB, a whole block above.
func groupFor(total, nseg int64) int64 {
	switch avg := total / max(nseg, 1); {
	case avg < 64:
		return 1
	case avg < 4096:
		return 32
	default:
		return blockThreads
	}
}

// grid covers threads threads with blocks of blockThreads, at most
// maxBlocks.
func grid(threads int64) gpu.Dim3 {
	return gpu.Dim3{X: int(min(max((threads+blockThreads-1)/blockThreads, 1), maxBlocks))}
}

// args lays out a kernel's by-value struct of 8-byte fields.
func args(fields ...uint64) []byte {
	out := make([]byte, 0, 8*len(fields))
	for _, f := range fields {
		out = binary.LittleEndian.AppendUint64(out, f)
	}
	return out
}
