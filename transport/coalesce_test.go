package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"strconv"
	"testing"
)

// appendFrame appends one bundle frame, as bundleAdd does.
func appendFrame(b []byte, id uint16, header, data []byte) []byte {
	b = binary.LittleEndian.AppendUint16(b, id)
	b = binary.AppendUvarint(b, uint64(len(header)))
	b = binary.AppendUvarint(b, uint64(len(data)))
	return append(append(b, header...), data...)
}

func TestNextFrame(t *testing.T) {
	b := appendFrame(nil, 7, []byte("hdr"), []byte("data!"))
	b = appendFrame(b, 9, nil, nil)
	f, rest, err := nextFrame(b)
	if err != nil || f.id != 7 || string(f.header) != "hdr" || string(f.data) != "data!" {
		t.Fatalf("first frame: %+v %v", f, err)
	}
	f, rest, err = nextFrame(rest)
	if err != nil || f.id != 9 || len(f.header) != 0 || len(f.data) != 0 || len(rest) != 0 {
		t.Fatalf("second frame: %+v rest %d %v", f, len(rest), err)
	}
	// Writing through a frame's slices must not reach the next frame.
	f, _, _ = nextFrame(b)
	if cap(f.data) != len(f.data) || cap(f.header) != len(f.header) {
		t.Fatal("frame slices may grow into the next frame")
	}
	for name, bad := range map[string][]byte{
		"empty":             {},
		"one byte":          {7},
		"no lengths":        {7, 0},
		"no data length":    {7, 0, 3},
		"header too long":   {7, 0, 9, 0, 'a'},
		"data too long":     {7, 0, 1, 5, 'a', 'b'},
		"length overflows":  append([]byte{7, 0}, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0),
		"sum overflows":     append([]byte{7, 0, 1}, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01),
		"unterminated uvar": {7, 0, 0x80, 0x80},
	} {
		if _, _, err := nextFrame(bad); !errors.Is(err, errBundle) {
			t.Errorf("%s: %v, want errBundle", name, err)
		}
	}
}

// FuzzBundleFrames: decoding any bytes as bundle frames never panics,
// never reads outside them, and accounts for every byte of a bundle that
// decodes.
func FuzzBundleFrames(f *testing.F) {
	b := appendFrame(nil, 0x41, []byte("envelope"), []byte("body"))
	f.Add(appendFrame(b, 0x42, []byte{1, 2}, nil))
	f.Add(b[:len(b)-1])
	f.Add([]byte{0x41, 0, 0xff, 0xff, 0xff, 0xff, 0x0f, 0})
	f.Fuzz(func(t *testing.T, in []byte) {
		rest := in
		used := 0
		for len(rest) > 0 {
			fr, next, err := nextFrame(rest)
			if err != nil {
				if !errors.Is(err, errBundle) {
					t.Fatalf("error %v is not errBundle", err)
				}
				return
			}
			if len(next) >= len(rest) {
				t.Fatal("a frame consumed nothing")
			}
			used += len(rest) - len(next)
			if len(fr.header)+len(fr.data) > len(rest) {
				t.Fatal("a frame larger than its input")
			}
			rest = next
		}
		if used != len(in) {
			t.Fatalf("frames cover %d of %d bytes", used, len(in))
		}
	})
}

// TestCoalesceKeepOrder: while the receiver is stuck in a handler, posts
// to it queue in UCX and then join bundles. Every message arrives, in
// order, before an active message sent after them; messages kept from a
// bundle stay valid after the bundle is gone, and their data can be
// received or released.
func TestCoalesceKeepOrder(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	const n = 4000
	release := make(chan struct{})
	kept := make(chan *AMMessage, n)
	if err := ts[1].SetAMHandler(20, func(m *AMMessage) {
		if string(m.Header) == "0" {
			<-release
		}
		m.Keep()
		kept <- m
	}); err != nil {
		t.Fatal(err)
	}
	marker := make(chan int, 1)
	if err := ts[1].SetAMHandler(21, func(*AMMessage) { marker <- len(kept) }); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		if err := ts[0].PostAM(1, 20, []byte(strconv.Itoa(i)), pattern(100+i%50, i)); err != nil {
			t.Fatal(err)
		}
	}
	bundles, msgs := ts[0].CoalesceStats()
	// A send after the posts leaves after them, bundles included.
	r, err := ts[0].SendAM(1, 21, []byte("end"), nil, AMAuto)
	if err != nil {
		t.Fatal(err)
	}
	close(release)
	if _, err := r.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-marker:
		if got != n {
			t.Fatalf("the active message sent after %d posts arrived after %d of them", n, got)
		}
	case <-ctx.Done():
		t.Fatal("the active message sent after the posts never arrived")
	}
	if bundles == 0 || msgs == 0 {
		t.Fatal("no post was coalesced: the bundle path went untested")
	}
	t.Logf("%d of %d posts left in %d bundles", msgs, n, bundles)
	for i := 0; i < n; i++ {
		m := <-kept
		want := pattern(100+i%50, i)
		if string(m.Header) != strconv.Itoa(i) || m.Size != len(want) || m.Rendezvous || !bytes.Equal(m.Data(), want) {
			t.Fatalf("message %d arrived as %q, %d bytes", i, m.Header, m.Size)
		}
		if i%2 == 1 {
			m.Release()
			continue
		}
		dst := make([]byte, m.Size)
		req, err := m.RecvData(dst)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := req.Wait(context.Background()); err != nil || !bytes.Equal(dst, want) {
			t.Fatalf("message %d: RecvData: %v", i, err)
		}
		if _, err := m.RecvData(dst); !errors.Is(err, ErrInvalid) {
			t.Fatalf("message %d: a second RecvData: %v", i, err)
		}
	}
}

// TestCoalesceOff: with NoCoalesce, posts to a stuck receiver queue in UCX
// one by one and none leaves in a bundle.
func TestCoalesceOff(t *testing.T) {
	ctx := testCtx(t)
	ts, stop, err := StartLocal(ctx, 2, Options{Progress: ProgressDirect, NoCoalesce: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	const n = 2000
	release := make(chan struct{})
	got := make(chan int, n)
	if err := ts[1].SetAMHandler(20, func(m *AMMessage) {
		i, _ := strconv.Atoi(string(m.Header))
		if i == 0 {
			<-release
		}
		got <- i
	}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		if err := ts[0].PostAM(1, 20, []byte(strconv.Itoa(i)), make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
	}
	close(release)
	for i := 0; i < n; i++ {
		select {
		case g := <-got:
			if g != i {
				t.Fatalf("message %d arrived as %d", i, g)
			}
		case <-ctx.Done():
			t.Fatalf("%d of %d messages", i, n)
		}
	}
	if b, m := ts[0].CoalesceStats(); b != 0 || m != 0 {
		t.Fatalf("NoCoalesce, yet %d messages left in %d bundles", m, b)
	}
	if ts[0].postsQueued.Load() == 0 {
		t.Fatal("no post was queued: the receiver never fell behind")
	}
}

// TestMalformedBundleDelivered: a bundle damaged on the wire (a frame for
// an id without a handler, a nested bundle, a frame cut short, a count
// that does not match) is delivered up to the damage; the rank goes on and
// later messages arrive.
func TestMalformedBundleDelivered(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	got := make(chan string, 16)
	if err := ts[1].SetAMHandler(20, func(m *AMMessage) {
		got <- string(m.Header) + "/" + string(m.Data())
	}); err != nil {
		t.Fatal(err)
	}
	good := appendFrame(nil, 20, []byte("a"), []byte("1"))
	good = appendFrame(good, 22, []byte("no handler"), nil)
	good = appendFrame(good, amBundle, []byte("nested"), nil)
	good = appendFrame(good, 20, []byte("b"), []byte("2"))
	cut := appendFrame(good, 20, []byte("c"), []byte("333"))
	cut = cut[:len(cut)-1]
	huge := appendFrame(nil, 20, []byte("d"), []byte("4"))
	huge = append(huge, 20, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0)
	for _, b := range []struct {
		n    uint64
		data []byte
	}{{9, good}, {5, cut}, {2, huge}, {1, nil}} {
		r, err := ts[0].sendAM(1, amBundle, binary.AppendUvarint(nil, b.n), b.data, AMEager)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	r, err := ts[0].sendAM(1, amBundle, []byte{0xff}, good, AMEager) // no count at all
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ts[0].PostAM(1, 20, []byte("end"), nil); err != nil {
		t.Fatal(err)
	}
	want := []string{"a/1", "b/2", "a/1", "b/2", "d/4", "end/"}
	for i, w := range want {
		select {
		case g := <-got:
			if g != w {
				t.Fatalf("message %d arrived as %q, want %q", i, g, w)
			}
		case <-ctx.Done():
			t.Fatalf("%d of %d messages arrived", i, len(want))
		}
	}
}
