package transport

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

// TestTypedBuffer: the MPI-style typed API with device buffers. Every pair
// of typedLayouts goes device to device, and device layouts meet Go-memory
// SendTyped and RecvTyped; the receive buffer holds what datatype's Pack and
// Unpack give on host memory, gaps unchanged. A signature mismatch fails
// both sides, and a shorter message fills the first elements only.
func TestTypedBuffer(t *testing.T) {
	sys := hostSystem(t)
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	layouts := typedLayouts(t)
	src := pattern(typedBufferSize, 21)
	old := pattern(typedBufferSize, 22)
	for sn, st := range layouts {
		for rn, rt := range layouts {
			for _, kinds := range [][2]bool{{true, true}, {true, false}, {false, true}} {
				sb, rb := typedBuf(t, sys, kinds[0], src), typedBuf(t, sys, kinds[1], old)
				done := make(chan error, 1)
				go func() {
					if kinds[0] {
						done <- ts[0].SendTypedBuffer(ctx, 1, 5, sb, st, 1)
						return
					}
					b, _ := sb.Bytes()
					done <- ts[0].SendTyped(ctx, 1, 5, b, st, 1) // the plain typed API, Go memory
				}()
				var stat Status
				var err error
				if kinds[1] {
					stat, err = ts[1].RecvTypedBuffer(ctx, 0, 5, rb, rt, 1)
				} else {
					b, _ := rb.Bytes()
					stat, err = ts[1].RecvTyped(ctx, 0, 5, b, rt, 1)
				}
				if err != nil {
					t.Fatalf("%s -> %s (device %v): recv: %v", sn, rn, kinds, err)
				}
				if err := <-done; err != nil {
					t.Fatalf("%s -> %s (device %v): send: %v", sn, rn, kinds, err)
				}
				if stat.Size != 256*8 || stat.Source != 0 {
					t.Fatalf("status %+v", stat)
				}
				if got := typedRead(t, rb); !bytes.Equal(got, typedWant(t, st, rt, src, old)) {
					t.Fatalf("%s -> %s (device %v): bytes differ from datatype's pack and unpack", sn, rn, kinds)
				}
			}
		}
	}
	if s := ts[0].ChannelTypedStats(); s.DevicePacked == 0 || s.StageAllocs > 2 {
		t.Fatalf("sender counters %+v: no device pack, or staging not reused", s)
	}

	// Another signature: int64s where float64s were sent.
	ints, err := datatype.Vector(64, 4, 7, datatype.Int64)
	if err != nil {
		t.Fatal(err)
	}
	keep := devBuf(t, sys, typedBufferSize, old)
	done := make(chan error, 1)
	floats := devBuf(t, sys, typedBufferSize, src)
	go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 6, floats, layouts["vector"], 1) }()
	if _, err := ts[1].RecvTypedBuffer(ctx, 0, 6, keep, ints, 1); !errors.Is(err, ErrTypeMismatch) {
		t.Fatalf("float64s into int64s: receiver %v, want ErrTypeMismatch", err)
	}
	if err := <-done; !errors.Is(err, ErrTypeMismatch) {
		t.Fatalf("float64s into int64s: sender %v, want ErrTypeMismatch", err)
	}
	if !bytes.Equal(readDev(t, keep), old) {
		t.Fatal("a mismatched receive wrote its buffer")
	}

	// 96 float64s into 32 elements of 8 (with gaps): the first 12 are filled.
	eight, err := datatype.Contiguous(8, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	row, err := datatype.Resized(eight, 0, 80) // 8 float64s, then a 16-byte gap
	if err != nil {
		t.Fatal(err)
	}
	before := pattern(32*80, 8)
	dst := devBuf(t, sys, 32*80, before)
	first := devBuf(t, sys, 768, src[:768])
	go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 7, first, datatype.Float64, 96) }()
	st, err := ts[1].RecvTypedBuffer(ctx, 0, 7, dst, row, 32)
	if err != nil || st.Size != 768 {
		t.Fatalf("96 float64s into 32 rows of 8: %v (size %d)", err, st.Size)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	want := bytes.Clone(before)
	if _, err := row.Unpack(want, src[:768], 0, 12); err != nil {
		t.Fatal(err)
	}
	if got := readDev(t, dst); !bytes.Equal(got, want) {
		t.Fatal("the 12 rows of a short message differ, or more was written")
	}
}

// TestTypedBufferErrors: bad layouts are refused before anything moves, and
// the message goes to the next receive.
func TestTypedBufferErrors(t *testing.T) {
	sys := hostSystem(t)
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec := typedLayouts(t)["vector"]
	short := devBuf(t, sys, 100, nil)
	if _, err := ts[1].RecvTypedBuffer(ctx, 0, 1, short, vec, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("receive into 100 bytes: %v, want ErrInvalid", err)
	}
	if err := ts[0].SendTypedBuffer(ctx, 1, 1, short, vec, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("send from 100 bytes: %v, want ErrInvalid", err)
	}
	if err := ts[0].SendTypedBuffer(ctx, 1, 1, gpu.Buffer{}, vec, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("zero buffer: %v", err)
	}
	src := pattern(typedBufferSize, 2)
	done := make(chan error, 1)
	sb := devBuf(t, sys, typedBufferSize, src)
	go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 1, sb, vec, 1) }()
	dst := devBuf(t, sys, typedBufferSize, nil)
	if _, err := ts[1].RecvTypedBuffer(ctx, 0, 1, dst, vec, 1); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readDev(t, dst), typedWant(t, vec, vec, src, make([]byte, typedBufferSize))) {
		t.Fatal("the message after refused calls differs")
	}
}

// TestTypedStage: a stage packs a layout at a base offset of a device (and
// a Go-memory) buffer into its Bytes exactly as datatype.Pack does on host
// memory, unpacks whole elements of a prefix back without touching the
// gaps, and refuses bad layouts and use after Release.
func TestTypedStage(t *testing.T) {
	sys := hostSystem(t)
	ts := localJob(t, 1, ProgressDirect)
	// Column 3 of a 40x12 float64 grid, origin at byte 3*8.
	col, err := datatype.Vector(40, 1, 12, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	const gridBytes = 40 * 12 * 8
	src := pattern(gridBytes, 31)
	want := make([]byte, 40*8)
	if _, err := col.Pack(want, src, 3*8, 1); err != nil {
		t.Fatal(err)
	}
	for _, device := range []bool{true, false} {
		sb := typedBuf(t, sys, device, src)
		s, err := ts[0].StageTyped(sb, col, 3*8, 1)
		if err != nil {
			t.Fatalf("device %v: %v", device, err)
		}
		if err := s.Pack(); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(s.Bytes, want) || s.Count != 1 || s.Twin.Size() != col.Size() {
			t.Fatalf("device %v: packed bytes differ from datatype.Pack, or count %d, twin %v", device, s.Count, s.Twin)
		}
		s.Release()

		// Unpack the first 10 rows (80 bytes, and 4 more that are not a
		// whole element) into column 3 of another grid.
		old := pattern(gridBytes, 32)
		db := typedBuf(t, sys, device, old)
		row, err := datatype.Resized(datatype.Float64, 0, 12*8)
		if err != nil {
			t.Fatal(err)
		}
		r, err := ts[0].StageTyped(db, row, 3*8, 40)
		if err != nil {
			t.Fatal(err)
		}
		copy(r.Bytes, want)
		if err := r.Unpack(84); err != nil {
			t.Fatal(err)
		}
		exp := bytes.Clone(old)
		if _, err := row.Unpack(exp, want[:80], 3*8, 10); err != nil {
			t.Fatal(err)
		}
		if got := typedRead(t, db); !bytes.Equal(got, exp) {
			t.Fatalf("device %v: unpacking 10 rows wrote other bytes", device)
		}
		if err := r.Unpack(int64(len(r.Bytes)) + 1); !errors.Is(err, ErrInvalid) {
			t.Fatalf("unpacking more than the stage: %v, want ErrInvalid", err)
		}
		r.Release()
		r.Release()
		if err := r.Pack(); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Pack after Release: %v, want ErrInvalid", err)
		}
	}
	small := devBuf(t, sys, 100, nil)
	if _, err := ts[0].StageTyped(small, col, 0, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a column of 40 rows in 100 bytes: %v, want ErrInvalid", err)
	}
	whole := devBuf(t, sys, gridBytes, nil)
	if _, err := ts[0].StageTyped(whole, col, 12*8, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a column starting a row late: %v, want ErrInvalid", err)
	}
	if s := ts[0].ChannelTypedStats(); s.DevicePacked != 2 || s.HostPacked != 2 {
		t.Fatalf("counters %+v: want 2 device and 2 host moves", s)
	}
}

// TestTypedBufferPieces: a device layout of many pack chunks is packed and
// unpacked piece by piece (one gpupack range per chunk on each device end,
// counted by the packers) as the chunks travel, into another layout of the
// same signature, device to device, device to Go memory and Go memory to
// device; the receive holds what datatype gives on the host, gaps
// unchanged. A large message of another signature leaves the device
// layout untouched.
func TestTypedBufferPieces(t *testing.T) {
	const chunk = 16 << 10
	sys := hostSystem(t)
	ts := chunkedJob(t, chunk)
	ctx := testCtx(t)
	dev, err := sys.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	must := func(ty *datatype.Type, err error) *datatype.Type {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return ty
	}
	send := must(datatype.Vector(8192, 3, 5, datatype.Float64)) // 192 KiB packed: 12 chunks
	recv := must(datatype.Vector(4096, 6, 7, datatype.Float64))
	size := int(max(send.Extent(), recv.Extent()))
	packed, err := send.PackedSize(1)
	if err != nil {
		t.Fatal(err)
	}
	pieces := (packed + chunk - 1) / chunk
	kernels := func(tr *Transport) int64 {
		p, err := tr.ctyped.packer(dev)
		if err != nil {
			t.Fatal(err)
		}
		return p.Stats().GoKernels
	}
	src, old := pattern(size, 31), pattern(size, 32)
	for _, kinds := range [][2]bool{{true, true}, {true, false}, {false, true}} {
		sb, rb := typedBuf(t, sys, kinds[0], src), typedBuf(t, sys, kinds[1], old)
		k0, k1 := kernels(ts[0]), kernels(ts[1])
		sent := ts[0].NoncontigStats().Sent.Pack
		done := make(chan error, 1)
		go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 8, sb, send, 1) }()
		st, err := ts[1].RecvTypedBuffer(ctx, 0, 8, rb, recv, 1)
		if err != nil {
			t.Fatalf("device %v: recv: %v", kinds, err)
		}
		if err := <-done; err != nil {
			t.Fatalf("device %v: send: %v", kinds, err)
		}
		if st.Size != int(packed) {
			t.Fatalf("device %v: status %+v, want %d bytes", kinds, st, packed)
		}
		if got := typedRead(t, rb); !bytes.Equal(got, typedWant(t, send, recv, src, old)) {
			t.Fatalf("device %v: bytes differ from datatype's pack and unpack", kinds)
		}
		if got := ts[0].NoncontigStats().Sent.Pack - sent; got != 1 {
			t.Fatalf("device %v: %d pack-scheme sends, want 1", kinds, got)
		}
		want := [2]int64{0, 0}
		for i, d := range kinds {
			if d {
				want[i] = pieces
			}
		}
		if got := [2]int64{kernels(ts[0]) - k0, kernels(ts[1]) - k1}; got != want {
			t.Fatalf("device %v: %v pack/unpack pieces (sender, receiver), want %v", kinds, got, want)
		}
	}

	// A staged call must pass the stage's own bytes, twin and count.
	stage, err := ts[0].StageTyped(devBuf(t, sys, size, src), send, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	for name, o := range map[string]struct {
		buf   []byte
		dt    *datatype.Type
		count int
		opts  TypedOptions
	}{
		"other bytes": {make([]byte, len(stage.Bytes)), stage.Twin, 1, TypedOptions{Stage: stage}},
		"the layout":  {stage.Bytes, send, 1, TypedOptions{Stage: stage}},
		"a base":      {stage.Bytes, stage.Twin, 1, TypedOptions{Stage: stage, Base: 8}},
		"packed":      {stage.Bytes, stage.Twin, 1, TypedOptions{Stage: stage, Packed: true}},
		"two":         {stage.Bytes, stage.Twin, 2, TypedOptions{Stage: stage}},
	} {
		if _, err := ts[0].IrecvTypedWith(1, 10, o.buf, o.dt, o.count, o.opts); !errors.Is(err, ErrInvalid) {
			t.Fatalf("staged receive with %s: %v, want ErrInvalid", name, err)
		}
	}
	if _, err := ts[1].IrecvTypedWith(0, 10, stage.Bytes, stage.Twin, 1, TypedOptions{Stage: stage}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("staged receive on another transport: %v, want ErrInvalid", err)
	}
	stage.Release()
	if _, err := ts[0].IsendTypedWith(1, 10, stage.Bytes, stage.Twin, 1, TypedOptions{Stage: stage}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("staged send after Release: %v, want ErrInvalid", err)
	}

	// int64s where float64s are sent: refused before a byte lands.
	ints := must(datatype.Vector(4096, 6, 7, datatype.Int64))
	keep := devBuf(t, sys, size, old)
	done := make(chan error, 1)
	sb := devBuf(t, sys, size, src) // allocated here: devBuf may t.Fatal
	go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 9, sb, send, 1) }()
	if _, err := ts[1].RecvTypedBuffer(ctx, 0, 9, keep, ints, 1); !errors.Is(err, ErrTypeMismatch) {
		t.Fatalf("recv of another signature: %v, want ErrTypeMismatch", err)
	}
	if err := <-done; !errors.Is(err, ErrTypeMismatch) {
		t.Fatalf("send of another signature: %v, want ErrTypeMismatch", err)
	}
	if !bytes.Equal(readDev(t, keep), old) {
		t.Fatal("a refused message wrote into the device layout")
	}
}

// TestTypedBufferLeftInFlight: a device send whose context has ended
// returns ctx's error with the transfer still in flight, but only once its
// layout is read no more: the sender then overwrites its buffer, and the
// receiver, posted after that, still gets the bytes as they were.
func TestTypedBufferLeftInFlight(t *testing.T) {
	sys := hostSystem(t)
	ts := localJob(t, 2, ProgressDirect)
	for _, tr := range ts {
		o := DefaultNoncontigOptions()
		o.PackChunk = 16 << 10
		if err := tr.SetNoncontigOptions(o); err != nil {
			t.Fatal(err)
		}
	}
	ctx := testCtx(t)
	vec, err := datatype.Vector(8192, 3, 5, datatype.Float64) // 192 KiB packed
	if err != nil {
		t.Fatal(err)
	}
	size := int(vec.Extent())
	ended, cancel := context.WithCancel(ctx)
	cancel()
	for i := range 8 {
		src, old := pattern(size, 40+i), pattern(size, 60+i)
		sb, rb := devBuf(t, sys, size, src), devBuf(t, sys, size, old)
		if err := ts[0].SendTypedBuffer(ended, 1, 11, sb, vec, 1); !errors.Is(err, context.Canceled) {
			t.Fatalf("send %d with an ended context: %v, want context.Canceled", i, err)
		}
		if err := gpu.Memset(sb, 0); err != nil {
			t.Fatal(err)
		}
		if _, err := ts[1].RecvTypedBuffer(ctx, 0, 11, rb, vec, 1); err != nil {
			t.Fatalf("recv %d: %v", i, err)
		}
		if !bytes.Equal(readDev(t, rb), typedWant(t, vec, vec, src, old)) {
			t.Fatalf("message %d: the receiver got bytes the sender wrote after SendTypedBuffer returned", i)
		}
	}
}

// TestTypedBufferPackFault: a device send whose pack kernel faults midway
// (piece 3 of 12) fails with the fault, and its receiver, which has
// unpacked the first pieces, fails too, with ErrWithdrawn, instead of
// waiting for chunks that never come. The next transfer of the same
// layout then goes through: the failed pack stream was replaced.
func TestTypedBufferPackFault(t *testing.T) {
	const chunk = 16 << 10
	sys, ts, ctx, vec, size := twelveChunkJob(t, chunk)
	boom := errors.New("injected kernel fault")
	faultPiece(t, false, 3*chunk, boom)
	src, old := pattern(size, 71), pattern(size, 72)
	done := make(chan error, 1)
	sb := devBuf(t, sys, size, src) // allocated here: devBuf may t.Fatal
	go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 12, sb, vec, 1) }()
	_, rerr := ts[1].RecvTypedBuffer(ctx, 0, 12, devBuf(t, sys, size, old), vec, 1)
	serr := <-done
	testPieceKernel = nil
	if !errors.Is(serr, boom) {
		t.Fatalf("send with a faulting pack kernel: %v, want the fault", serr)
	}
	if !errors.Is(rerr, ErrWithdrawn) {
		t.Fatalf("recv of a send whose packing faulted: %v, want ErrWithdrawn", rerr)
	}
	for i := range 2 {
		rb, sb := devBuf(t, sys, size, old), devBuf(t, sys, size, src)
		go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 13, sb, vec, 1) }()
		if _, err := ts[1].RecvTypedBuffer(ctx, 0, 13, rb, vec, 1); err != nil {
			t.Fatalf("recv %d after the fault: %v", i, err)
		}
		if err := <-done; err != nil {
			t.Fatalf("send %d after the fault: %v", i, err)
		}
		if !bytes.Equal(readDev(t, rb), typedWant(t, vec, vec, src, old)) {
			t.Fatalf("transfer %d after the fault: bytes differ", i)
		}
	}
}

// chunkedJob starts two local ranks whose typed transfers pack in chunks
// of chunk bytes.
func chunkedJob(t *testing.T, chunk int) []*Transport {
	t.Helper()
	ts := localJob(t, 2, ProgressDirect)
	for _, tr := range ts {
		o := DefaultNoncontigOptions()
		o.PackChunk = chunk
		if err := tr.SetNoncontigOptions(o); err != nil {
			t.Fatal(err)
		}
	}
	return ts
}

// TestTypedBufferLeftInFlightFault: a device send left in flight by an
// ended context whose pack kernel faults midway: SendTypedBuffer waits for
// the packing (readsDone) while the transfer, in its own goroutine, meets
// the fault and retires the pack stream; the two must not race on the
// stage (run under the race detector). The send's caller gets ctx's
// error, the receiver ErrWithdrawn, and the next transfer goes through.
func TestTypedBufferLeftInFlightFault(t *testing.T) {
	const chunk = 16 << 10
	sys, ts, ctx, vec, size := twelveChunkJob(t, chunk)
	ended, cancel := context.WithCancel(ctx)
	cancel()
	boom := errors.New("injected kernel fault")
	src, old := pattern(size, 81), pattern(size, 82)
	for i := range 16 {
		faultPiece(t, false, 1*chunk, boom)
		sb := devBuf(t, sys, size, src)
		if err := ts[0].SendTypedBuffer(ended, 1, 14, sb, vec, 1); !errors.Is(err, context.Canceled) {
			t.Fatalf("send %d with an ended context: %v, want context.Canceled", i, err)
		}
		// When SendTypedBuffer packed the stage whole before the transfer
		// began (readsDone), no piece kernel ran and the message is whole.
		rb := devBuf(t, sys, size, old)
		_, err := ts[1].RecvTypedBuffer(ctx, 0, 14, rb, vec, 1)
		switch {
		case err == nil:
			if !bytes.Equal(readDev(t, rb), typedWant(t, vec, vec, src, old)) {
				t.Fatalf("recv %d: bytes differ", i)
			}
		case !errors.Is(err, ErrWithdrawn):
			t.Fatalf("recv %d of a send whose packing faulted: %v, want ErrWithdrawn or the message", i, err)
		}
		testPieceKernel = nil
	}
	done := make(chan error, 1)
	rb, sb := devBuf(t, sys, size, old), devBuf(t, sys, size, src)
	go func() { done <- ts[0].SendTypedBuffer(ctx, 1, 15, sb, vec, 1) }()
	if _, err := ts[1].RecvTypedBuffer(ctx, 0, 15, rb, vec, 1); err != nil {
		t.Fatalf("recv after the faults: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("send after the faults: %v", err)
	}
	if !bytes.Equal(readDev(t, rb), typedWant(t, vec, vec, src, old)) {
		t.Fatal("transfer after the faults: bytes differ")
	}
}

// twelveChunkJob starts two local ranks packing typed transfers in chunks
// of chunk bytes (chunkedJob), with the host gpu system opened first, and
// returns a vector that packs into 12 such chunks of 16 KiB and its
// extent.
func twelveChunkJob(t *testing.T, chunk int) (*gpu.System, []*Transport, context.Context, *datatype.Type, int) {
	t.Helper()
	sys := hostSystem(t)
	ts := chunkedJob(t, chunk)
	vec, err := datatype.Vector(8192, 3, 5, datatype.Float64) // 192 KiB packed: 12 chunks of 16 KiB
	if err != nil {
		t.Fatal(err)
	}
	return sys, ts, testCtx(t), vec, int(vec.Extent())
}
