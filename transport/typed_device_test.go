package transport

import (
	"bytes"
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
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	sys := hostSystem(t)
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
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	sys := hostSystem(t)
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
