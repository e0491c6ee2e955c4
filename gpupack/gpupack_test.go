package gpupack

import (
	"bytes"
	"errors"
	"iter"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/internal/cudarun"
	"github.com/troupe-hpc/troupe/internal/cudatest"
)

// TestPTXUpToDate: the embedded PTX is what clang makes of kernels.cu now
// (skipped without clang; `make ptx` regenerates it).
func TestPTXUpToDate(t *testing.T) { cudatest.RequirePTX(t, "kernels.cu", "kernels.ptx") }

func must[T any](t *testing.T) func(T, error) T {
	return func(v T, err error) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

func ok(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// layout is a test case: count elements of a type at byte base of a user
// buffer of size bytes.
type layout struct {
	name              string
	t                 *datatype.Type
	base, count, size int64
	regular           bool // moved by the vector kernel on cuda
}

// testLayouts builds layouts that take every path: regular vectors with
// 8-byte words and with bytes, a contiguous run, irregular tables of short,
// medium and long blocks, negative displacements, several elements.
func testLayouts(t *testing.T) []layout {
	mk := func(ty *datatype.Type, err error) *datatype.Type {
		t.Helper()
		ok(t, err)
		ok(t, ty.Commit())
		return ty
	}
	f64 := datatype.Float64
	col := mk(datatype.Vector(64, 1, 33, f64))          // 8-byte blocks, 264 B apart
	odd := mk(datatype.Vector(50, 3, 7, datatype.Byte)) // 3-byte blocks: byte units
	rows := mk(datatype.Vector(16, 600, 1000, f64))     // 4800-byte blocks
	idx := mk(datatype.Indexed([]int64{1, 3, 2, 5, 1}, []int64{0, 4, 12, 20, 40}, f64))
	hidx := mk(datatype.HIndexed([]int64{5, 17, 2, 9}, []int64{3, 40, 101, 150}, datatype.Byte))
	sub := mk(datatype.Subarray([]int64{9, 10, 11}, []int64{4, 5, 6}, []int64{2, 3, 4}, datatype.OrderC, datatype.Int32))
	long := mk(datatype.HIndexed([]int64{3000, 200, 12000}, []int64{0, 40000, 50000}, datatype.Byte))
	medium := mk(datatype.HIndexed([]int64{128, 512, 256}, []int64{0, 1024, 2048}, datatype.Byte))
	mediumOdd := mk(datatype.HIndexed([]int64{100, 700, 301}, []int64{3, 1001, 2000}, datatype.Byte))
	st := mk(datatype.Struct([]int64{1, 2, 1}, []int64{0, 16, 64}, []*datatype.Type{datatype.Int32, col, datatype.Float64}))
	neg := mk(datatype.Resized(mk(datatype.HVector(8, 2, -40, datatype.Int64)), -400, 512))
	ext := func(ty *datatype.Type, base, count int64) int64 {
		_, hi, err := ty.DataBounds(count)
		ok(t, err)
		return base + hi + 13
	}
	return []layout{
		{name: "vector-f64-column", t: col, count: 3, regular: false, base: 0, size: ext(col, 0, 3)},
		{name: "vector-f64-column-one", t: col, count: 1, regular: true, base: 8, size: ext(col, 8, 1)},
		{name: "vector-3-bytes", t: odd, count: 1, regular: true, base: 5, size: ext(odd, 5, 1)},
		{name: "vector-rows", t: rows, count: 1, regular: true, base: 64, size: ext(rows, 64, 1)},
		{name: "contiguous", t: mk(datatype.Contiguous(1000, f64)), count: 2, regular: true, base: 16, size: 16016 + 7},
		{name: "indexed", t: idx, count: 4, base: 24, size: ext(idx, 24, 4)},
		{name: "hindexed-bytes", t: hidx, count: 3, base: 1, size: ext(hidx, 1, 3)},
		{name: "subarray-3d", t: sub, count: 2, base: 0, size: ext(sub, 0, 2)},
		{name: "long-blocks", t: long, count: 1, base: 8, size: ext(long, 8, 1)},
		{name: "medium-blocks", t: medium, count: 2, base: 8, size: ext(medium, 8, 2)},
		{name: "medium-blocks-bytes", t: mediumOdd, count: 1, base: 0, size: ext(mediumOdd, 0, 1)},
		{name: "struct", t: st, count: 5, base: 32, size: ext(st, 32, 5)},
		{name: "negative-stride", t: neg, count: 3, base: 800, size: ext(neg, 800, 3)},
	}
}

func randomBytes(r *rand.Rand, n int64) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// checkPacker packs and unpacks every test layout on dev and compares with
// datatype's Pack and Unpack of the same bytes on the host: the packed
// stream, and the user buffer after unpacking (gaps untouched).
func checkPacker(t *testing.T, dev *gpu.Device) *Packer {
	p := must[*Packer](t)(New(dev, Options{}))
	t.Cleanup(func() { ok(t, p.Close()) })
	st := must[*gpu.Stream](t)(dev.NewStream())
	t.Cleanup(func() { st.Destroy() })
	r := rand.New(rand.NewPCG(5, 6))
	alloc := func(n int64) gpu.Buffer {
		b := must[gpu.Buffer](t)(dev.Alloc(int(n)))
		t.Cleanup(func() { gpu.Free(b) })
		return b
	}
	load := func(b gpu.Buffer) []byte {
		out := make([]byte, b.Len())
		ok(t, gpu.CopyToHost(out, b))
		return out
	}
	for _, l := range testLayouts(t) {
		size := must[int64](t)(l.t.PackedSize(l.count))
		host := randomBytes(r, l.size)
		user, packed := alloc(l.size), alloc(size+5)
		ok(t, gpu.CopyFromHost(user, host))
		ok(t, gpu.Memset(packed, 0xee))

		want := make([]byte, size)
		must[int64](t)(l.t.Pack(want, host, l.base, l.count))
		n, err := p.Pack(st, packed, user, l.t, l.base, l.count)
		ok(t, err)
		ok(t, st.Synchronize())
		if n != size {
			t.Fatalf("%s: Pack returned %d, want %d", l.name, n, size)
		}
		got := load(packed)
		if !bytes.Equal(got[:size], want) {
			t.Fatalf("%s on %v: packed stream differs from datatype's Pack", l.name, dev)
		}
		if !bytes.Equal(got[size:], bytes.Repeat([]byte{0xee}, 5)) {
			t.Fatalf("%s on %v: Pack wrote past the packed size", l.name, dev)
		}

		// Unpack another stream into the same user bytes.
		stream := randomBytes(r, size)
		wantUser := bytes.Clone(host)
		must[int64](t)(l.t.Unpack(wantUser, stream, l.base, l.count))
		ok(t, gpu.CopyFromHost(must[gpu.Buffer](t)(packed.Slice(0, int(size))), stream))
		n, err = p.Unpack(st, user, packed, l.t, l.base, l.count)
		ok(t, err)
		ok(t, st.Synchronize())
		if n != size {
			t.Fatalf("%s: Unpack returned %d, want %d", l.name, n, size)
		}
		if !bytes.Equal(load(user), wantUser) {
			t.Fatalf("%s on %v: user buffer after Unpack differs from datatype's Unpack (blocks or gaps)", l.name, dev)
		}
	}
	return p
}

// checkRanges packs and unpacks every test layout range by range, with
// ranges of several sizes (unaligned ones included), and compares with
// datatype's Pack and Unpack; a range outside the stream is refused.
func checkRanges(t *testing.T, dev *gpu.Device) {
	p := must[*Packer](t)(New(dev, Options{}))
	defer p.Close()
	st := must[*gpu.Stream](t)(dev.NewStream())
	defer st.Destroy()
	r := rand.New(rand.NewPCG(9, 10))
	for _, l := range testLayouts(t) {
		size := must[int64](t)(l.t.PackedSize(l.count))
		host := randomBytes(r, l.size)
		user := must[gpu.Buffer](t)(dev.Alloc(int(l.size)))
		packed := must[gpu.Buffer](t)(dev.Alloc(int(size)))
		ok(t, gpu.CopyFromHost(user, host))
		want := make([]byte, size)
		must[int64](t)(l.t.Pack(want, host, l.base, l.count))
		stream := randomBytes(r, size)
		wantUser := bytes.Clone(host)
		must[int64](t)(l.t.Unpack(wantUser, stream, l.base, l.count))
		for _, chunk := range []int64{1, 7, 8, 24, 1000, size/3 + 1} {
			// byRanges moves the stream range by range with move, and waits.
			byRanges := func(name string, move func(piece gpu.Buffer, off, n int64) (int64, error)) {
				t.Helper()
				for off := int64(0); off < size; off += chunk {
					n := min(chunk, size-off)
					piece := must[gpu.Buffer](t)(packed.Slice(int(off), int(n)))
					if got, err := move(piece, off, n); err != nil || got != n {
						t.Fatalf("%s: %s(%d, %d) = %d, %v", l.name, name, off, n, got, err)
					}
				}
				ok(t, st.Synchronize())
			}
			ok(t, gpu.Memset(packed, 0xee))
			byRanges("PackRange", func(piece gpu.Buffer, off, n int64) (int64, error) {
				return p.PackRange(st, piece, user, l.t, l.base, l.count, off, n)
			})
			got := make([]byte, size)
			ok(t, gpu.CopyToHost(got, packed))
			if !bytes.Equal(got, want) {
				t.Fatalf("%s on %v: packed by ranges of %d bytes, the stream differs from datatype's Pack", l.name, dev, chunk)
			}

			ok(t, gpu.CopyFromHost(user, host))
			ok(t, gpu.CopyFromHost(packed, stream))
			byRanges("UnpackRange", func(piece gpu.Buffer, off, n int64) (int64, error) {
				return p.UnpackRange(st, user, piece, l.t, l.base, l.count, off, n)
			})
			gotUser := make([]byte, l.size)
			ok(t, gpu.CopyToHost(gotUser, user))
			if !bytes.Equal(gotUser, wantUser) {
				t.Fatalf("%s on %v: unpacked by ranges of %d bytes, the user buffer differs from datatype's Unpack", l.name, dev, chunk)
			}
			ok(t, gpu.CopyFromHost(user, host))
		}
		for _, bad := range [][2]int64{{-1, 1}, {size, 1}, {0, size + 1}, {1, -1}, {size - 1, 2}} {
			if _, err := p.PackRange(st, packed, user, l.t, l.base, l.count, bad[0], bad[1]); !errors.Is(err, ErrInvalid) {
				t.Fatalf("%s: PackRange(%d, %d) = %v, want ErrInvalid", l.name, bad[0], bad[1], err)
			}
		}
		short := must[gpu.Buffer](t)(packed.Slice(0, int(size/2)))
		if _, err := p.UnpackRange(st, user, short, l.t, l.base, l.count, 0, size/2+1); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%s: UnpackRange from a short buffer = %v, want ErrInvalid", l.name, err)
		}
		ok(t, gpu.Free(packed))
		ok(t, gpu.Free(user))
	}
}

// hostDevice opens device 0 of a host-backend system.
func hostDevice(t *testing.T) *gpu.Device { return openDevice(t, gpu.BackendHost) }

func openDevice(t *testing.T, backend string) *gpu.Device {
	t.Helper()
	sys := must[*gpu.System](t)(gpu.OpenBackend(backend))
	t.Cleanup(func() { ok(t, sys.Close()) })
	return must[*gpu.Device](t)(sys.Device(0))
}

// TestHost: the host backend moves every layout with Go kernels.
func TestHost(t *testing.T) {
	p := checkPacker(t, hostDevice(t))
	s := p.Stats()
	if n := int64(2 * len(testLayouts(t))); s.GoKernels != n || s.Vector+s.Table+s.TablesBuilt != 0 {
		t.Fatalf("stats %+v, want %d Go kernels and nothing else", s, n)
	}
	t.Run("Ranges", func(t *testing.T) { checkRanges(t, hostDevice(t)) })
}

// TestCUDA runs the layouts through the cuda backend's kernels: on a GPU
// when there is one, else on the test CUDA driver (internal/cudatest) with
// kernels.cu compiled in for the host, in a child process that loads it.
func TestCUDA(t *testing.T) {
	if cudarun.OnTestDriver(t, "TestCUDA", 2*time.Minute, "kernels.cu") {
		return
	}
	dev := openDevice(t, gpu.BackendCUDA)
	t.Logf("cuda device %v", dev)
	p := checkPacker(t, dev)
	var regular, irregular int64
	for _, l := range testLayouts(t) {
		if l.regular {
			regular++
		} else {
			irregular++
		}
	}
	s := p.Stats()
	if s.GoKernels != 0 || s.Vector != 2*regular || s.Table != 2*irregular || s.TablesBuilt != irregular {
		t.Fatalf("stats %+v, want %d vector and %d table moves, %d tables", s, 2*regular, 2*irregular, irregular)
	}
	t.Run("Ranges", func(t *testing.T) { checkRanges(t, dev) })
	t.Run("Cache", func(t *testing.T) { checkCache(t, dev) })
	t.Run("CacheRegular", func(t *testing.T) { checkCacheRegular(t, dev) })
	t.Run("CloseRace", func(t *testing.T) { checkPlanAfterClose(t, dev) })
	t.Run("HeldPlan", func(t *testing.T) { checkHeldPlan(t, dev) })
	t.Run("Errors", func(t *testing.T) { checkErrors(t, dev) })
}

// checkCache: a layout's second use builds no table; a cache bounded to one
// table evicts the older one and still moves both correctly.
func checkCache(t *testing.T, dev *gpu.Device) {
	ls := testLayouts(t)
	a, b := ls[5], ls[6] // indexed, hindexed-bytes: both tables
	p, run := oneTableCache(t, dev, a, b, 7)
	run(a)
	run(a)
	if s := p.Stats(); s.TablesBuilt != 1 || s.TablesEvicted != 0 {
		t.Fatalf("after two uses of one layout: %+v, want one table built", s)
	}
	run(b) // evicts a's table
	run(a) // builds it again
	if s := p.Stats(); s.TablesBuilt != 3 || s.TablesEvicted != 2 || s.Table != 4 {
		t.Fatalf("with room for one table: %+v, want 3 built, 2 evicted, 4 table moves", s)
	}
}

// checkCacheRegular: a regular layout's plan holds no device memory, so a
// cache over its bound evicts tables only: with room for one table, a
// regular layout used first and then two tables, one table is evicted and
// the regular plan is kept.
func checkCacheRegular(t *testing.T, dev *gpu.Device) {
	ls := testLayouts(t)
	reg, a, b := ls[1], ls[5], ls[6] // vector-f64-column-one (regular); indexed, hindexed-bytes (tables)
	if !reg.regular {
		t.Fatalf("%s is not a regular layout", reg.name)
	}
	p, run := oneTableCache(t, dev, a, b, 11)
	run(reg)
	run(a)
	run(b) // over the bound: a's table goes, nothing else
	if s := p.Stats(); s.TablesBuilt != 2 || s.TablesEvicted != 1 {
		t.Fatalf("a regular layout and two tables with room for one: %+v, want 2 tables built, 1 evicted", s)
	}
	p.mu.Lock()
	_, kept := p.plans[planKey{reg.t, reg.count}]
	p.mu.Unlock()
	if !kept {
		t.Fatal("the regular layout's plan was evicted, though it holds no device memory")
	}
}

// checkPlanAfterClose: a move that passed its checks just before another
// goroutine closed the packer reaches plan after Close (the interleaving is
// played here in order): it must fail instead of building and caching a
// device table that nothing frees any more.
func checkPlanAfterClose(t *testing.T, dev *gpu.Device) {
	l := testLayouts(t)[5] // indexed: a table
	p := must[*Packer](t)(New(dev, Options{}))
	ok(t, p.Close())
	if _, err := p.plan(l.t, l.count); !errors.Is(err, ErrInvalid) {
		t.Fatalf("plan after Close: %v, want ErrInvalid", err)
	}
	p.mu.Lock()
	n, bytes := p.lru.Len(), p.bytes
	p.mu.Unlock()
	if n != 0 || bytes != 0 {
		t.Fatalf("after Close the packer caches %d plans of %d device bytes, which nothing frees", n, bytes)
	}
}

// TestErrorsHost: bad arguments are refused before anything is enqueued.
func TestErrorsHost(t *testing.T) { checkErrors(t, hostDevice(t)) }

func checkErrors(t *testing.T, dev *gpu.Device) {
	p := must[*Packer](t)(New(dev, Options{MaxSegments: 4}))
	st := must[*gpu.Stream](t)(dev.NewStream())
	defer st.Destroy()
	ty := must[*datatype.Type](t)(datatype.Vector(4, 2, 5, datatype.Int32)) // bytes [0, 68), 32 packed
	ok(t, ty.Commit())
	user := must[gpu.Buffer](t)(dev.Alloc(100))
	defer gpu.Free(user)
	packed := must[gpu.Buffer](t)(dev.Alloc(32))
	defer gpu.Free(packed)
	ok(t, gpu.Memset(user, 7))
	ok(t, gpu.Memset(packed, 9))

	freedType := must[*datatype.Type](t)(datatype.Contiguous(2, datatype.Int32))
	ok(t, freedType.Commit())
	ok(t, freedType.Free())
	freedBuf := must[gpu.Buffer](t)(dev.Alloc(100))
	ok(t, gpu.Free(freedBuf))
	other := must[*gpu.System](t)(gpu.OpenBackend(gpu.BackendHost))
	defer other.Close()
	foreign := must[gpu.Buffer](t)(must[*gpu.Device](t)(other.Device(0)).Alloc(100))
	irregular := must[*datatype.Type](t)(datatype.Indexed([]int64{1, 1, 1, 1, 1}, []int64{0, 2, 5, 9, 14}, datatype.Int32))
	ok(t, irregular.Commit())
	small := must[gpu.Buffer](t)(user.Slice(0, 67))
	short := must[gpu.Buffer](t)(packed.Slice(0, 31))
	overlapping := must[gpu.Buffer](t)(user.Slice(60, 32))

	cases := []struct {
		name string
		err  func() error
		want error
	}{
		{"user too small", func() error { _, err := p.Pack(st, packed, small, ty, 0, 1); return err }, ErrInvalid},
		{"base past the layout", func() error { _, err := p.Unpack(st, user, packed, ty, 40, 1); return err }, ErrInvalid},
		{"negative base", func() error { _, err := p.Pack(st, packed, user, ty, -4, 1); return err }, ErrInvalid},
		{"negative base, data inside", func() error {
			at8, err := datatype.HIndexed([]int64{4}, []int64{8}, datatype.Byte) // data at [8, 12)
			if err != nil {
				return err
			}
			_, err = p.Pack(st, packed, user, at8, -4, 1)
			return err
		}, ErrInvalid},
		{"packed too short", func() error { _, err := p.Pack(st, short, user, ty, 0, 1); return err }, ErrInvalid},
		{"negative count", func() error { _, err := p.Pack(st, packed, user, ty, 0, -1); return err }, datatype.ErrInvalidArgument},
		{"freed type", func() error { _, err := p.Pack(st, packed, user, freedType, 0, 1); return err }, datatype.ErrFreed},
		{"freed buffer", func() error { _, err := p.Unpack(st, freedBuf, packed, ty, 0, 1); return err }, gpu.ErrFreed},
		{"foreign buffer", func() error { _, err := p.Pack(st, packed, foreign, ty, 0, 1); return err }, gpu.ErrForeign},
		{"overlap", func() error { _, err := p.Pack(st, overlapping, user, ty, 0, 1); return err }, ErrInvalid},
		{"nil type", func() error { _, err := p.Pack(st, packed, user, nil, 0, 1); return err }, ErrInvalid},
		{"zero buffer", func() error { _, err := p.Pack(st, gpu.Buffer{}, user, ty, 0, 1); return err }, ErrInvalid},
	}
	if dev.Backend() == gpu.BackendCUDA {
		// Only device code needs a table; the host backend moves any layout.
		cases = append(cases, struct {
			name string
			err  func() error
			want error
		}{"too many segments", func() error { _, err := p.Pack(st, packed, user, irregular, 0, 1); return err }, ErrTooManySegments})
	}
	for _, c := range cases {
		err := c.err()
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		} else {
			t.Logf("%s: %v", c.name, err)
		}
	}
	ok(t, st.Synchronize())
	// Nothing was written.
	got := make([]byte, 100)
	ok(t, gpu.CopyToHost(got, user))
	if !bytes.Equal(got, bytes.Repeat([]byte{7}, 100)) {
		t.Fatal("a refused move wrote the user buffer")
	}
	got = got[:32]
	ok(t, gpu.CopyToHost(got, packed))
	if !bytes.Equal(got, bytes.Repeat([]byte{9}, 32)) {
		t.Fatal("a refused move wrote the packed buffer")
	}
	// The packer still works, then refuses work once closed.
	if _, err := p.Pack(st, packed, user, ty, 0, 1); err != nil {
		t.Fatalf("after the refusals: %v", err)
	}
	ok(t, st.Synchronize())
	ok(t, p.Close())
	if _, err := p.Pack(st, packed, user, ty, 0, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("after Close: %v", err)
	}
}

// checkHeldPlan: a plan a move holds (between plan and its kernel's launch)
// keeps its table when another move's build evicts it, until the holder
// gives it back (the table was freed at eviction, and the holder's kernel
// launched with a freed table); Close waits for held plans.
func checkHeldPlan(t *testing.T, dev *gpu.Device) {
	ls := testLayouts(t)
	a, b := ls[5], ls[6]                                    // indexed, hindexed-bytes: both tables
	p := must[*Packer](t)(New(dev, Options{CacheBytes: 1})) // room for none: every build evicts the others
	held := must[*plan](t)(p.plan(a.t, a.count))
	if held.table.IsZero() {
		t.Fatalf("%s has no table", a.name)
	}
	other := must[*plan](t)(p.plan(b.t, b.count)) // evicts a's plan
	if s := p.Stats(); s.TablesEvicted != 1 {
		t.Fatalf("TablesEvicted = %d, want 1", s.TablesEvicted)
	}
	probe := make([]byte, 1)
	if err := gpu.CopyToHost(probe, must[gpu.Buffer](t)(held.table.Slice(0, 1))); err != nil {
		t.Fatalf("the held plan's table was freed at eviction: %v", err)
	}
	p.unpin(held)
	if err := gpu.CopyToHost(probe, must[gpu.Buffer](t)(held.table.Slice(0, 1))); !errors.Is(err, gpu.ErrFreed) {
		t.Fatalf("the evicted table after its last holder gave it back: %v, want ErrFreed", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	p.mu.Lock()
	for !p.closed { // Close has begun: it waits for other's holder
		p.mu.Unlock()
		runtime.Gosched()
		p.mu.Lock()
	}
	p.mu.Unlock()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a move held a plan", err)
	default:
	}
	if err := gpu.CopyToHost(probe, must[gpu.Buffer](t)(other.table.Slice(0, 1))); err != nil {
		t.Fatalf("Close freed a held plan's table: %v", err)
	}
	p.unpin(other)
	ok(t, <-closed)
}

// oneTableCache returns a Packer whose cache has room for the larger of
// a's and b's tables only (closed with the test), and a function that
// packs a layout with it on a stream of its own and checks the packed
// stream against datatype's; seed seeds the layouts' random bytes.
func oneTableCache(t *testing.T, dev *gpu.Device, a, b layout, seed uint64) (*Packer, func(layout)) {
	tableBytes := func(l layout) int64 {
		n := int64(0)
		for range must[iter.Seq[datatype.Segment]](t)(l.t.Segments(l.count, 0, -1)) {
			n++
		}
		return n * segBytes
	}
	p := must[*Packer](t)(New(dev, Options{CacheBytes: max(tableBytes(a), tableBytes(b))}))
	t.Cleanup(func() { p.Close() })
	st := must[*gpu.Stream](t)(dev.NewStream())
	t.Cleanup(func() { st.Destroy() })
	r := rand.New(rand.NewPCG(seed, seed+1))
	return p, func(l layout) {
		t.Helper()
		size := must[int64](t)(l.t.PackedSize(l.count))
		host := randomBytes(r, l.size)
		user := must[gpu.Buffer](t)(dev.Alloc(int(l.size)))
		defer gpu.Free(user)
		packed := must[gpu.Buffer](t)(dev.Alloc(int(size)))
		defer gpu.Free(packed)
		ok(t, gpu.CopyFromHost(user, host))
		must[int64](t)(p.Pack(st, packed, user, l.t, l.base, l.count))
		ok(t, st.Synchronize())
		want := make([]byte, size)
		must[int64](t)(l.t.Pack(want, host, l.base, l.count))
		got := make([]byte, size)
		ok(t, gpu.CopyToHost(got, packed))
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: packed stream differs", l.name)
		}
	}
}
