package transport

import (
	"bytes"
	"errors"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// TestQueueTyped: every pair of typedLayouts goes from rank 0's queue to
// rank 1's, device memory on both ends, packed by the trigger agent and
// unpacked before the completion counter advances: after the receiving
// stream passes its Wait the buffer holds exactly what datatype's Pack and
// Unpack on host memory give (gaps unchanged). A typed send also meets an
// ordinary Recv of the packed size.
func TestQueueTyped(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	sys0, s0, q0 := hostQueue(t, ts[0])
	sys1, s1, q1 := hostQueue(t, ts[1])
	layouts := typedLayouts(t)
	src := pattern(typedBufferSize, 11)
	old := pattern(typedBufferSize, 12)
	tag := 0
	for sn, st := range layouts {
		for rn, rt := range layouts {
			tag++
			want := typedWant(t, st, rt, src, old)
			sb, rb := devBuf(t, sys0, typedBufferSize, src), devBuf(t, sys1, typedBufferSize, old)
			so, err := q0.EnqueueSendTyped(sb, st, 1, 1, tag)
			if err != nil {
				t.Fatal(err)
			}
			ro, err := q1.EnqueueRecvTyped(rb, rt, 1, 0, tag)
			if err != nil {
				t.Fatal(err)
			}
			startWait(t, q1)
			startWait(t, q0)
			if err := s1.Synchronize(); err != nil {
				t.Fatalf("%s -> %s: receiving stream: %v", sn, rn, err)
			}
			if err := s0.Synchronize(); err != nil {
				t.Fatal(err)
			}
			for _, o := range []*QueueOp{so, ro} {
				if _, err := o.Wait(ctx); err != nil {
					t.Fatalf("%s -> %s: %s: %v", sn, rn, o.kind(), err)
				}
			}
			if got := readDev(t, rb); !bytes.Equal(got, want) {
				t.Fatalf("%s -> %s: bytes differ from datatype's pack and unpack", sn, rn)
			}
		}
	}
	// A typed send meets a plain receive of the packed size.
	vec := layouts["vector"]
	if _, err := q0.EnqueueSendTyped(devBuf(t, sys0, typedBufferSize, src), vec, 1, 1, 99); err != nil {
		t.Fatal(err)
	}
	startWait(t, q0)
	got := make([]byte, 256*8)
	if _, err := ts[1].Recv(ctx, 0, 99, got); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 256*8)
	_, _ = vec.Pack(want, src, 0, 1)
	if !bytes.Equal(got, want) {
		t.Fatal("a plain receive of a typed queue send: bytes differ from datatype's pack")
	}
	if err := s0.Synchronize(); err != nil {
		t.Fatal(err)
	}
}

// TestQueueTypedErrors: layouts the buffer cannot hold are refused when
// enqueued; a message of another packed size puts the receiving queue in
// error with ErrTruncated, and its buffer keeps what it held.
func TestQueueTypedErrors(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	sys, s, q := hostQueue(t, ts[1])
	vec := typedLayouts(t)["vector"]
	short := devBuf(t, sys, 100, nil)
	if _, err := q.EnqueueRecvTyped(short, vec, 1, 0, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("receive into a 100-byte buffer: %v, want ErrInvalid", err)
	}
	if _, err := q.EnqueueSendTyped(short, vec, -1, 0, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("negative count: %v, want ErrInvalid", err)
	}
	if _, err := q.EnqueueRecvTyped(devBuf(t, sys, typedBufferSize, nil), vec, 1, -1, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("wildcard source: %v, want ErrInvalid", err)
	}
	fewer, err := datatype.Vector(65, 4, 7, datatype.Float64) // packs 2080 bytes, 2048 sent
	if err != nil {
		t.Fatal(err)
	}
	keep := pattern(typedBufferSize, 4)
	dst := devBuf(t, sys, typedBufferSize, keep)
	o, err := q.EnqueueRecvTyped(dst, fewer, 1, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	startWait(t, q)
	if err := ts[0].Send(ctx, 1, 2, pattern(256*8, 1)); err != nil {
		t.Fatal(err)
	}
	if _, err := o.Wait(ctx); !errors.Is(err, ErrTruncated) {
		t.Fatalf("2048 bytes into a layout of 2080: %v, want ErrTruncated", err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(q.Err(), ErrTruncated) {
		t.Fatalf("queue error %v, want ErrTruncated", q.Err())
	}
	if !bytes.Equal(readDev(t, dst), keep) {
		t.Fatal("a failed typed receive wrote its buffer")
	}
}
