package actor

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// The bytes of a declined CUDA IPC device message, between in-process
// ranks on the host backend (the whole exchange, with a driver that
// refuses handles, is integration's TestGPUMessagingIPC/shm-declined): the
// sender answers a request for a pending message with its buffer's bytes,
// the receiver takes only the size it expects, forged requests and bytes
// are counted and ignored, and Shutdown ends a wait for bytes.
func TestDeviceResend(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	want := []byte(strings.Repeat("declined", 8))
	buf, err := dev.Alloc(len(want))
	if err != nil {
		t.Fatal(err)
	}
	if err := gpu.CopyFromHost(buf, want); err != nil {
		t.Fatal(err)
	}
	ask := func(seq uint64) {
		t.Helper()
		hdr := appendString(appendUint(appendUint(nil, 1), seq), "test: the driver refused the handle")
		if _, err := rts[1].t.SendAM(0, amDeviceResend, hdr, nil, transport.AMEager); err != nil {
			t.Fatal(err)
		}
	}
	get := func(ch chan resend) resend {
		t.Helper()
		select {
		case res := <-ch:
			return res
		case <-time.After(10 * time.Second):
			t.Fatal("no bytes")
			return resend{}
		}
	}

	// The bytes of a pending message reach the waiting receiver; the
	// sender's Completion still waits for the receiver's acknowledgement.
	seq, c := rts[0].devSends.add(1, rts[0].t, buf)
	ch, err := rts[1].devResends.add(0, seq, len(want))
	if err != nil {
		t.Fatal(err)
	}
	ask(seq)
	res := get(ch)
	if res.err != nil {
		t.Fatal(res.err)
	}
	if _, err := res.req.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(res.host, want) {
		t.Fatalf("got %q, want %q", res.host, want)
	}
	waitFor(t, func() bool { return rts[0].Stats().DeviceIPCResent.Load() == 1 })
	if c.Err() != nil || isDone(c) {
		t.Fatalf("completion done (%v) before the receiver acknowledged", c.Err())
	}
	rts[1].ackDevice(0, seq, "")
	if err := c.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}

	// A receiver expecting another size gets an error, not the bytes.
	seq, _ = rts[0].devSends.add(1, rts[0].t, buf)
	if ch, err = rts[1].devResends.add(0, seq, len(want)/2); err != nil {
		t.Fatal(err)
	}
	ask(seq)
	if res := get(ch); res.err == nil || !strings.Contains(res.err.Error(), "64 bytes for a device payload of 32") {
		t.Fatalf("bytes of the wrong size: %v", res.err)
	}

	// A request for no pending message, and bytes nobody waits for, are
	// counted and ignored.
	errs0, errs1 := rts[0].Stats().DecodeErrors.Load(), rts[1].Stats().DecodeErrors.Load()
	ask(seq + 1000)
	waitFor(t, func() bool { return rts[0].Stats().DecodeErrors.Load() == errs0+1 })
	hdr := appendString(appendUint(appendUint(nil, 0), seq+1000), "")
	if _, err := rts[0].t.SendAM(1, amDeviceBytes, hdr, want, transport.AMEager); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return rts[1].Stats().DecodeErrors.Load() == errs1+1 })

	// A receiver waiting for bytes that will not come is released by
	// Shutdown.
	dst, err := dev.Alloc(len(want))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rts[1].fetchDeclined(0, seq+2000, dst, errors.New("test: declined")) }()
	waitFor(t, func() bool { return rts[0].Stats().DecodeErrors.Load() == errs0+2 }) // the sender has no such message
	shutdownAll(t, rts)
	select {
	case err := <-done:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("wait for bytes after Shutdown: %v, want ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown left a receiver waiting for bytes")
	}
}

func isDone(c *Completion) bool {
	select {
	case <-c.Done():
		return true
	default:
		return false
	}
}
