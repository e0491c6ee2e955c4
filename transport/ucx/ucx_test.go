package ucx_test

import (
	"bytes"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// loop is one worker with an endpoint to itself: every call of the binding
// runs against real UCX (the self and shared-memory transports), in one
// process, with the test goroutine as the worker's only user.
type loop struct {
	t   testing.TB
	ctx *ucx.Context
	w   *ucx.Worker
	ep  *ucx.Endpoint
	pin runtime.Pinner
	// seen holds events drained while waiting for another one.
	seen []ucx.Event
}

func newLoop(t testing.TB) *loop {
	t.Helper()
	ctx, err := ucx.NewContext(ucx.FeatureTag|ucx.FeatureAM|ucx.FeatureRMA|ucx.FeatureWakeup, nil)
	if err != nil {
		t.Fatalf("NewContext: %v", err)
	}
	w, err := ctx.NewWorker(ucx.ThreadSingle)
	if err != nil {
		ctx.Close()
		t.Fatalf("NewWorker: %v", err)
	}
	addr, err := w.Address()
	if err != nil || len(addr) == 0 {
		t.Fatalf("Address: %d bytes, %v", len(addr), err)
	}
	ep, err := w.Connect(addr, false)
	if err != nil {
		t.Fatalf("Connect to own address: %v", err)
	}
	l := &loop{t: t, ctx: ctx, w: w, ep: ep}
	t.Cleanup(l.close)
	return l
}

func (l *loop) close() {
	if r, err := l.w.CloseEndpoint(l.ep, false); err != nil {
		l.t.Errorf("CloseEndpoint: %v", err)
	} else {
		l.wait(r)
	}
	l.w.Close()
	l.ctx.Close()
	l.pin.Unpin()
}

// buf pins b for the lifetime of the loop and describes it.
func (l *loop) buf(b []byte) ucx.Buffer {
	l.pin.Pin(&b[0])
	return ucx.Buffer{Ptr: unsafe.Pointer(&b[0]), Len: len(b)}
}

// next progresses the worker until an event satisfying match arrives and
// returns it; other events are kept in l.seen. It fails the test after 10 s.
func (l *loop) next(match func(*ucx.Event) bool) ucx.Event {
	l.t.Helper()
	for i, ev := range l.seen {
		if match(&ev) {
			l.seen = append(l.seen[:i], l.seen[i+1:]...)
			return ev
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		evs, _ := l.w.Progress()
		var found *ucx.Event
		for i := range evs {
			ev := evs[i] // a copy: evs is reused by the next Progress
			if found == nil && match(&ev) {
				found = &ev
				continue
			}
			l.seen = append(l.seen, ev)
		}
		if found != nil {
			return *found
		}
	}
	l.t.Fatalf("no matching event within 10 s; %d others seen", len(l.seen))
	return ucx.Event{}
}

// wait waits for the completion event of r, if r is in flight, and returns
// its status.
func (l *loop) wait(r ucx.Request) ucx.Status {
	l.t.Helper()
	if !r.Pending() {
		return ucx.StatusOK
	}
	ev := l.next(func(e *ucx.Event) bool { return e.Request() == r })
	return ev.Status()
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131) + seed
	}
	return b
}

// TestTagSendRecv sends eager and rendezvous sizes to the worker itself and
// checks bytes, sender tag and length of every receive.
func TestTagSendRecv(t *testing.T) {
	l := newLoop(t)
	for i, n := range []int{1, 100, 8 << 10, 64 << 10, 1 << 20} {
		tag := uint64(0x1000 + i)
		src, dst := pattern(n, byte(i)), make([]byte, n)
		rr, err := l.w.TagRecv(l.buf(dst), tag, ^uint64(0))
		if err != nil {
			t.Fatalf("TagRecv %d B: %v", n, err)
		}
		if !rr.Pending() {
			t.Fatalf("TagRecv %d B completed at once; receives always report an event", n)
		}
		sr, err := l.w.TagSend(l.ep, l.buf(src), tag)
		if err != nil {
			t.Fatalf("TagSend %d B: %v", n, err)
		}
		ev := l.next(func(e *ucx.Event) bool { return e.Kind() == ucx.EventRecv && e.Request() == rr })
		if ev.Status() != ucx.StatusOK || ev.SenderTag() != tag || ev.Length() != n {
			t.Fatalf("%d B: receive event status %v tag %#x length %d; want OK %#x %d", n, ev.Status(), ev.SenderTag(), ev.Length(), tag, n)
		}
		if st := l.wait(sr); st != ucx.StatusOK {
			t.Fatalf("%d B: send completed with %v", n, st)
		}
		if !bytes.Equal(dst, src) {
			t.Fatalf("%d B: received bytes differ from those sent", n)
		}
	}
}

// TestTagRecvTruncated: a receive buffer shorter than the message completes
// with StatusTruncated, and the worker goes on working.
func TestTagRecvTruncated(t *testing.T) {
	l := newLoop(t)
	src, short := pattern(256, 1), make([]byte, 64)
	rr, err := l.w.TagRecv(l.buf(short), 7, ^uint64(0))
	if err != nil {
		t.Fatal(err)
	}
	sr, err := l.w.TagSend(l.ep, l.buf(src), 7)
	if err != nil {
		t.Fatal(err)
	}
	if st := l.wait(rr); st != ucx.StatusTruncated {
		t.Fatalf("short receive: status %v, want %v", st, ucx.StatusTruncated)
	}
	l.wait(sr)
	// The worker is still usable.
	dst := make([]byte, 256)
	rr, _ = l.w.TagRecv(l.buf(dst), 8, ^uint64(0))
	sr, _ = l.w.TagSend(l.ep, l.buf(src), 8)
	if st := l.wait(rr); st != ucx.StatusOK || !bytes.Equal(dst, src) {
		t.Fatalf("receive after a truncation: status %v, bytes equal %v", st, bytes.Equal(dst, src))
	}
	l.wait(sr)
}

// TestTagRecvIOV receives a contiguous message into an IOV list of three
// entries and probes a message before receiving it.
func TestTagRecvIOV(t *testing.T) {
	l := newLoop(t)
	src := pattern(3000, 9)
	parts := [][]byte{make([]byte, 1000), make([]byte, 1500), make([]byte, 500)}
	iov := ucx.NewIOV(len(parts))
	defer iov.Free()
	for i, p := range parts {
		iov.Set(i, l.buf(p).Ptr, len(p))
	}
	if iov.Len() != 3 {
		t.Fatalf("IOV Len %d, want 3", iov.Len())
	}
	if p, n := iov.Entry(1); p != unsafe.Pointer(&parts[1][0]) || n != 1500 {
		t.Fatalf("IOV Entry(1) = %p, %d", p, n)
	}
	sr, err := l.w.TagSend(l.ep, l.buf(src), 42)
	if err != nil {
		t.Fatal(err)
	}
	// Probe (and take) the message, then receive it into the IOV list.
	var (
		m    ucx.Message
		info ucx.RecvInfo
		ok   bool
	)
	deadline := time.Now().Add(10 * time.Second)
	for !ok && time.Now().Before(deadline) {
		evs, _ := l.w.Progress()
		l.seen = append(l.seen, evs...)
		m, info, ok = l.w.TagProbe(42, ^uint64(0), true)
	}
	if !ok || info.Tag != 42 || info.Length != len(src) {
		t.Fatalf("TagProbe: found %v tag %d length %d; want tag 42 length %d", ok, info.Tag, info.Length, len(src))
	}
	rr, err := l.w.TagMsgRecv(ucx.Buffer{IOV: iov}, m)
	if err != nil {
		t.Fatal(err)
	}
	if st := l.wait(rr); st != ucx.StatusOK {
		t.Fatalf("TagMsgRecv into IOV: %v", st)
	}
	l.wait(sr)
	if got := bytes.Join(parts, nil); !bytes.Equal(got, src) {
		t.Fatal("IOV entries do not hold the message in order")
	}
}

// TestCancel: a cancelled receive reports StatusCanceled.
func TestCancel(t *testing.T) {
	l := newLoop(t)
	rr, err := l.w.TagRecv(l.buf(make([]byte, 16)), 99, ^uint64(0))
	if err != nil {
		t.Fatal(err)
	}
	if st := rr.Status(); st != ucx.StatusInProgress {
		t.Fatalf("unmatched receive: status %v, want in progress", st)
	}
	l.w.Cancel(rr)
	if st := l.wait(rr); st != ucx.StatusCanceled {
		t.Fatalf("cancelled receive: status %v, want %v", st, ucx.StatusCanceled)
	}
}

// TestCancelNow: an unmatched receive is cancelled at once, its event
// already queued when CancelNow returns; a receive that matched a message
// is not cancelled and delivers it.
func TestCancelNow(t *testing.T) {
	l := newLoop(t)
	rr, err := l.w.TagRecv(l.buf(make([]byte, 16)), 100, ^uint64(0))
	if err != nil {
		t.Fatal(err)
	}
	if !l.w.CancelNow(rr) {
		t.Fatal("CancelNow of an unmatched receive reported false")
	}
	evs := l.w.Drain() // no progress call: the event must be queued already
	if len(evs) != 1 || evs[0].Request() != rr || evs[0].Status() != ucx.StatusCanceled {
		t.Fatalf("events after CancelNow: %d, want one StatusCanceled for the receive", len(evs))
	}

	msg := []byte("matched!")
	sr, err := l.w.TagSend(l.ep, l.buf(msg), 101)
	if err != nil {
		t.Fatal(err)
	}
	if st := l.wait(sr); st != ucx.StatusOK {
		t.Fatalf("send: %v", st)
	}
	for deadline := time.Now().Add(10 * time.Second); ; { // until it waits in the unexpected queue
		if _, _, ok := l.w.TagProbe(101, ^uint64(0), false); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the message never arrived")
		}
		evs, _ := l.w.Progress()
		l.seen = append(l.seen, evs...)
	}
	got := make([]byte, 16)
	rr, err = l.w.TagRecv(l.buf(got), 101, ^uint64(0)) // matches the queued message
	if err != nil {
		t.Fatal(err)
	}
	if l.w.CancelNow(rr) {
		t.Fatal("CancelNow of a receive that matched a message reported true")
	}
	ev := l.next(func(e *ucx.Event) bool { return e.Request() == rr })
	if ev.Status() != ucx.StatusOK || ev.Length() != len(msg) || !bytes.Equal(got[:len(msg)], msg) {
		t.Fatalf("matched receive after CancelNow: %v, %d B %q", ev.Status(), ev.Length(), got[:ev.Length()])
	}
	if l.w.CancelNow(ucx.Request{}) {
		t.Fatal("CancelNow of no request reported true")
	}
}

// TestActiveMessages sends an eager and a rendezvous active message with a
// header and checks what the queueing handler delivers.
func TestActiveMessages(t *testing.T) {
	l := newLoop(t)
	const id = 5
	if err := l.w.SetAMHandler(id); err != nil {
		t.Fatal(err)
	}
	header := []byte("hdr-0123")
	l.pin.Pin(&header[0])
	for _, c := range []struct {
		n     int
		flags uint32
	}{{200, ucx.AMSendEager}, {4 << 20, ucx.AMSendRndv}} {
		data := pattern(c.n, 3)
		sr, err := l.w.AMSend(l.ep, id, header, l.buf(data), c.flags)
		if err != nil {
			t.Fatalf("AMSend %d B: %v", c.n, err)
		}
		ev := l.next(func(e *ucx.Event) bool { return e.Kind() == ucx.EventAM })
		if ev.AMID() != id || !bytes.Equal(ev.AMHeader(), header) || ev.Length() != c.n {
			t.Fatalf("%d B: AM event id %d header %q length %d", c.n, ev.AMID(), ev.AMHeader(), ev.Length())
		}
		got := make([]byte, c.n)
		if ev.AMRendezvous() {
			if ev.AMData() != nil {
				t.Fatal("rendezvous AM event returns eager data")
			}
			r, n, err := l.w.AMRecvData(ev.AMDescriptor(), l.buf(got))
			if err != nil {
				t.Fatalf("AMRecvData: %v", err)
			}
			if r.Pending() {
				de := l.next(func(e *ucx.Event) bool { return e.Kind() == ucx.EventAMData && e.Request() == r })
				if de.Status() != ucx.StatusOK {
					t.Fatalf("AM data: %v", de.Status())
				}
				n = de.Length()
			}
			if n != c.n {
				t.Fatalf("AM data length %d, want %d", n, c.n)
			}
		} else {
			if c.flags == ucx.AMSendRndv {
				t.Fatalf("%d B sent with the rendezvous flag arrived eager", c.n)
			}
			copy(got, ev.AMData())
			ev.ReleaseData(l.w)
		}
		ev.FreeHeader()
		if st := l.wait(sr); st != ucx.StatusOK {
			t.Fatalf("AM send: %v", st)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("%d B: AM data differs from what was sent", c.n)
		}
	}
}

// TestAMPost: a posted AM needs no request and its buffers may be reused at
// once; the receiver sees the bytes as they were at the call.
func TestAMPost(t *testing.T) {
	l := newLoop(t)
	if err := l.w.SetAMHandler(6); err != nil {
		t.Fatal(err)
	}
	header, data := []byte("h"), pattern(512, 4)
	want := bytes.Clone(data)
	if _, err := l.w.AMPost(l.ep, 6, header, data, 0); err != nil {
		t.Fatal(err)
	}
	for i := range data {
		data[i] = 0 // the copy in C memory must not see this
	}
	ev := l.next(func(e *ucx.Event) bool { return e.Kind() == ucx.EventAM })
	got, hdr := bytes.Clone(ev.AMData()), string(ev.AMHeader())
	l.w.AMRelease([]ucx.Event{ev})
	if !bytes.Equal(got, want) || hdr != "h" {
		t.Fatalf("posted AM: header %q, data equal %v; want \"h\" and the bytes at the call", hdr, bytes.Equal(got, want))
	}
	if l.w.PostFailed() != 0 {
		t.Fatalf("PostFailed = %d", l.w.PostFailed())
	}
}

// TestPutGet registers memory, exchanges its key with itself and writes and
// reads it with RMA.
func TestPutGet(t *testing.T) {
	l := newLoop(t)
	target := make([]byte, 4096)
	l.pin.Pin(&target[0])
	base := uintptr(unsafe.Pointer(&target[0]))
	m, err := l.ctx.MemMap(base, len(target))
	if err != nil {
		t.Fatalf("MemMap: %v", err)
	}
	defer func() {
		if err := m.Unmap(); err != nil {
			t.Errorf("Unmap: %v", err)
		}
	}()
	packed, err := m.PackRkey()
	if err != nil || len(packed) == 0 {
		t.Fatalf("PackRkey: %d bytes, %v", len(packed), err)
	}
	k, err := l.ep.UnpackRkey(packed)
	if err != nil {
		t.Fatalf("UnpackRkey: %v", err)
	}
	defer k.Destroy()
	src := pattern(1000, 7)
	r, err := l.w.Put(l.ep, l.buf(src).Ptr, len(src), uint64(base+100), k)
	if err != nil {
		t.Fatalf("Put: %v", err)
	}
	l.wait(r)
	if r, err = l.w.Flush(l.ep); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	l.wait(r)
	if !bytes.Equal(target[100:1100], src) || target[99] != 0 || target[1100] != 0 {
		t.Fatal("Put did not write exactly [100, 1100) of the target")
	}
	back := make([]byte, 1000)
	if r, err = l.w.Get(l.ep, l.buf(back).Ptr, len(back), uint64(base+100), k); err != nil {
		t.Fatalf("Get: %v", err)
	}
	l.wait(r)
	if r, err = l.w.FlushWorker(); err != nil {
		t.Fatalf("FlushWorker: %v", err)
	}
	l.wait(r)
	if !bytes.Equal(back, src) {
		t.Fatal("Get read other bytes than Put wrote")
	}
}

// TestErrors: bad arguments come back as *ucx.Error naming the call.
func TestErrors(t *testing.T) {
	l := newLoop(t)
	_, err := l.w.Connect(nil, false)
	var ue *ucx.Error
	if !errors.As(err, &ue) || ue.Op != "ucp_ep_create" {
		t.Fatalf("Connect(nil): %v, want a *ucx.Error for ucp_ep_create", err)
	}
	if _, err := l.ep.UnpackRkey(nil); ucx.StatusOf(err) == ucx.StatusOK {
		t.Fatalf("UnpackRkey(nil): %v, want an error with a status", err)
	}
	_, err = ucx.NewContext(ucx.FeatureTag, map[string]string{"RNDV_THRESH": "not-a-size"})
	if err == nil || !strings.Contains(err.Error(), "RNDV_THRESH=not-a-size") {
		t.Fatalf("NewContext with RNDV_THRESH=not-a-size: %v, want an error naming the setting", err)
	}
	if ucx.StatusOf(errors.New("plain")) != ucx.StatusOK {
		t.Fatal("StatusOf of an error without a status is not OK")
	}
	if s := ucx.StatusTruncated.String(); s == "" {
		t.Fatal("Status.String is empty")
	}
}

// TestWakeup: after Signal the armed worker's event fd is readable, which
// is what a rank sleeping in poll relies on.
func TestWakeup(t *testing.T) {
	l := newLoop(t)
	fd, err := l.w.EventFD()
	if err != nil {
		t.Fatalf("EventFD: %v", err)
	}
	// Arm until UCX has nothing pending.
	for {
		err := l.w.Arm()
		if err == nil {
			break
		}
		if ucx.StatusOf(err) != ucx.StatusBusy {
			t.Fatalf("Arm: %v", err)
		}
		l.w.Progress()
	}
	if err := l.w.Signal(); err != nil {
		t.Fatalf("Signal: %v", err)
	}
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd, 10000)
	if err != nil || n != 1 || pfd[0].Revents&unix.POLLIN == 0 {
		t.Fatalf("poll after Signal: n %d revents %#x err %v; want the fd readable", n, pfd[0].Revents, err)
	}
}

// TestInfo: the context describes its transports, and the version is UCX's.
func TestInfo(t *testing.T) {
	l := newLoop(t)
	if info := l.ctx.Info(); info == "" {
		t.Fatal("Info is empty")
	}
	if v := ucx.Version(); len(v) < 5 || v[0] != '1' {
		t.Fatalf("Version %q, want 1.x.y", v)
	}
	types, err := l.ctx.MemoryTypes()
	if err != nil {
		t.Fatalf("MemoryTypes: %v", err)
	}
	if !types.Has(ucx.MemoryHost) {
		t.Fatalf("memory types %#x lack host memory", uint64(types))
	}
}
