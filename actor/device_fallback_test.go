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

// TestDeviceResendSenderCannotStage: a sender whose buffer cannot be copied
// to host memory for a receiver that declined CUDA IPC says so in its
// amDeviceBytes; the receiver fails the message and acknowledges with the
// reason, as after any landing. That acknowledgement completes the
// sender's Completion with the reason. The sender used to finish the
// Completion itself when it sent the failure, so the receiver's
// acknowledgement then found no message and was counted as a decode error
// (a forged acknowledgement) on a legitimate exchange.
func TestDeviceResendSenderCannotStage(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	buf, err := dev.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	if err := gpu.Free(buf); err != nil { // the copy to host memory fails
		t.Fatal(err)
	}
	dst, err := dev.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	errs0 := rts[0].Stats().DecodeErrors.Load()
	seq, c := rts[0].devSends.add(1, rts[0].t, buf)
	// The receiver's landing goroutine, as receiveDeviceIPC runs it.
	ferr := rts[1].fetchDeclined(0, seq, dst, errors.New("test: the driver refused the handle"))
	if ferr == nil || !strings.Contains(ferr.Error(), "could not copy") {
		t.Fatalf("fetchDeclined: %v, want the sender's failure to copy", ferr)
	}
	// landedIPC's acknowledgement, then one for another message: when
	// that one is done, rank 0 has handled the first.
	rts[1].ackDevice(0, seq, "device payload: "+ferr.Error())
	seq2, c2 := rts[0].devSends.add(1, rts[0].t, gpu.Buffer{})
	rts[1].ackDevice(0, seq2, "")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c2.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	var de *DeviceIPCError
	if err := c.Wait(ctx); !errors.As(err, &de) || de.Rank != 1 || !strings.Contains(de.Reason, "could not copy") {
		t.Fatalf("completion: %v, want a *DeviceIPCError from rank 1 with the sender's failure to copy", err)
	}
	if n := rts[0].Stats().DecodeErrors.Load(); n != errs0 {
		t.Fatalf("decode errors on the sender: %d, want %d (the acknowledgement is legitimate)", n, errs0)
	}
}
