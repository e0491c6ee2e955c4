package actor

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"strings"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// The receiving half of CUDA IPC device messages against hostile or broken
// input, between in-process ranks on the host backend (the sending half
// and the copies need two processes on the cuda backend: integration's
// TestGPUMessagingIPC). Every malformed message is a dead letter with a
// reason, the sender's Completion fails with that reason when the message
// named one, and the runtime keeps working.
func TestDeviceIPCMalformed(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	sink := &deviceSink{seen: make(chan halo, 4)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "sink"); err != nil {
		t.Fatal(err)
	}
	haloType, _, err := lookupType(&halo{})
	if err != nil {
		t.Fatal(err)
	}
	pingType, _, err := lookupType(&ping{})
	if err != nil {
		t.Fatal(err)
	}
	// post sends an IPC device message of type id typ with data, as a
	// sender would.
	post := func(typ uint32, payloadLen int, data []byte) {
		t.Helper()
		body, _, err := appendBody(nil, haloType, &halo{Iter: 9}, true)
		if err != nil {
			t.Fatal(err)
		}
		e := envelope{Flags: flagPointer | flagBodyHdr | flagDeviceIPC | flagNoCredit, Source: 0, Target: "sink",
			Type: typ, PayloadLen: payloadLen, Body: body}
		if err := rts[0].t.PostAM(1, amActor, appendEnvelope(nil, &e), data); err != nil {
			t.Fatal(err)
		}
	}
	withSeq := func(desc []byte, seq uint64) []byte {
		return binary.LittleEndian.AppendUint64(append([]byte(nil), desc...), seq)
	}
	dead := rts[1].Stats().DeadLetters.Load()
	for _, tc := range []struct {
		name string
		typ  uint32
		data []byte // nil: a garbage descriptor; with a registered sequence number unless short
		want string // in the Completion's error ("": no acknowledgement expected)
	}{
		{"short data", haloType.id, make([]byte, 10), ""},
		{"garbage descriptor", haloType.id, nil, "malformed"},
		{"unknown type", 0x5eed, nil, "unknown message type"},
		{"no device field", pingType.id, nil, "no gpu.Buffer field"},
		// A well-formed descriptor, from a rank this one does not use CUDA
		// IPC with: nothing is allocated or mapped.
		{"not an IPC peer", haloType.id, wellFormedDesc(t, 64), "not a CUDA IPC peer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c *Completion
			data := tc.data
			if tc.want != "" {
				desc := data
				if desc == nil {
					desc = make([]byte, transport.DeviceDescSize)
				}
				var seq uint64
				seq, c = rts[0].devSends.add(1, rts[0].t, gpu.Buffer{})
				data = withSeq(desc, seq)
			}
			post(tc.typ, 64, data)
			if c != nil {
				select {
				case <-c.Done():
				case <-time.After(10 * time.Second):
					t.Fatal("no acknowledgement")
				}
				var de *DeviceIPCError
				if !errors.As(c.Err(), &de) || de.Rank != 1 || !strings.Contains(de.Reason, tc.want) {
					t.Fatalf("completion: %v, want a *DeviceIPCError from rank 1 saying %q", c.Err(), tc.want)
				}
			}
			dead++
			waitFor(t, func() bool { return rts[1].Stats().DeadLetters.Load() == dead })
		})
	}
	// A forged acknowledgement (no such message) is counted, not obeyed.
	errsBefore := rts[0].Stats().DecodeErrors.Load()
	seq, c := rts[0].devSends.add(1, rts[0].t, gpu.Buffer{})
	hdr := appendString(appendUint(appendUint(nil, 1), seq+1000), "")
	if _, err := rts[1].t.SendAM(0, amDeviceAck, hdr, nil, transport.AMEager); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return rts[0].Stats().DecodeErrors.Load() == errsBefore+1 })
	if c.Err() != nil {
		t.Fatal("a forged acknowledgement completed another message")
	}
	// The runtime still delivers device messages.
	src, err := dev.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	if err := rts[0].Send(rts[0].PID(1, "sink"), &halo{Iter: 1, Face: src}); err != nil {
		t.Fatal(err)
	}
	select {
	case h := <-sink.seen:
		if h.Iter != 1 || h.Face.Len() != 64 {
			t.Fatalf("got %+v", h)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no message after the malformed ones")
	}
	// Shutdown fails what is still pending.
	shutdownAll(t, rts)
	if !errors.Is(c.Err(), ErrClosed) {
		t.Fatalf("pending completion after Shutdown: %v", c.Err())
	}
}

// TestSendDeviceNoIPC: without CUDA IPC (in-process ranks, or a rank of
// this process), SendDevice's Completion for a small buffer is done when it
// returns; a large one goes on the pair channel and completes with its
// send.
func TestSendDeviceNoIPC(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	sink := &deviceSink{seen: make(chan halo, 4)}
	for _, rt := range rts {
		if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return sink }), "sink"); err != nil {
			t.Fatal(err)
		}
	}
	src, _ := dev.Alloc(100)
	for r := range rts {
		c, err := rts[0].SendDevice(nil, rts[0].PID(r, "sink"), &halo{Iter: r, Face: src})
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-c.Done():
		default:
			t.Fatalf("to rank %d: completion pending", r)
		}
		if c.Err() != nil {
			t.Fatal(c.Err())
		}
		if h := <-sink.seen; h.Iter != r || h.Face.Len() != 100 {
			t.Fatalf("to rank %d: got %+v", r, h)
		}
	}
	big, _ := dev.Alloc(PairDeviceMin)
	want := make([]byte, PairDeviceMin)
	for i := range want {
		want[i] = byte(i * 7)
	}
	if err := gpu.CopyFromHost(big, want); err != nil {
		t.Fatal(err)
	}
	c, err := rts[0].SendDevice(nil, rts[0].PID(1, "sink"), &halo{Iter: 9, Face: big})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	h := <-sink.seen
	got := make([]byte, PairDeviceMin)
	if err := gpu.CopyToHost(got, h.Face); err != nil {
		t.Fatal(err)
	}
	if h.Iter != 9 || !bytes.Equal(got, want) {
		t.Fatalf("pair channel message %d: bytes equal %v", h.Iter, bytes.Equal(got, want))
	}
	if s, r := rts[0].Stats().DevicePairSent.Load(), rts[1].Stats().DevicePair.Load(); s != 1 || r != 1 {
		t.Fatalf("pair channel: %d sent, %d landed; want 1 and 1", s, r)
	}
	if _, err := rts[0].SendDevice(nil, nil, &halo{}); err == nil {
		t.Fatal("SendDevice to a nil PID succeeded")
	}
}

// waitFor polls cond until it holds, failing t after 10 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10 s")
		}
		time.Sleep(time.Millisecond)
	}
}

// shutdownAll shuts the in-process ranks down together (Shutdown is
// collective).
func shutdownAll(t *testing.T, rts []*Runtime) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errs := make(chan error, len(rts))
	for _, rt := range rts {
		go func() { errs <- rt.Shutdown(ctx) }()
	}
	for range rts {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// wellFormedDesc is a descriptor transport.DeviceDescLength accepts, of a
// buffer of n bytes (its handle names no allocation).
func wellFormedDesc(t *testing.T, n int) []byte {
	t.Helper()
	d := make([]byte, transport.DeviceDescSize)
	copy(d, "troupe-g")
	binary.LittleEndian.PutUint64(d[8:], 2)          // an IPC handle
	binary.LittleEndian.PutUint64(d[16:], uint64(n)) // length
	binary.LittleEndian.PutUint64(d[96:], uint64(n)) // allocation size
	if got, err := transport.DeviceDescLength(d); err != nil || got != n {
		t.Fatalf("DeviceDescLength = %d, %v", got, err)
	}
	return d
}
