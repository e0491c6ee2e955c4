package actor

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// devGrid returns a device buffer (host backend) holding data.
func devGrid(t testing.TB, dev *gpu.Device, data []byte) gpu.Buffer {
	t.Helper()
	b, err := dev.Alloc(len(data))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = gpu.Free(b) })
	if err := gpu.CopyFromHost(b, data); err != nil {
		t.Fatal(err)
	}
	return b
}

func devBytes(t *testing.T, b gpu.Buffer) []byte {
	t.Helper()
	out := make([]byte, b.Len())
	if err := gpu.CopyToHost(out, b); err != nil {
		t.Fatal(err)
	}
	return out
}

// A column of a 512x300 float64 grid in device memory is sent as a Typed
// field (Dev), along both paths, into a column of a grid of another width
// in device memory, in Go memory, and kept packed; a Go-memory column goes
// into device memory too. Every landing holds exactly the column, the rest
// of the destination grid unchanged; a device layout whose signature
// differs is refused as a host one is.
func TestTypedDeviceFields(t *testing.T) {
	for _, path := range typedPaths {
		t.Run(path.name, func(t *testing.T) {
			testTypedDeviceFields(t, path.min, path.direct)
		})
	}
}

func testTypedDeviceFields(t *testing.T, min int, direct bool) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{TypedDirectMin: min})
	const rows = 512
	colOf := func(width int64) *datatype.Type { return gridColumn(t, rows, width) }
	src := patterned(rows*300*8, 7, 3)
	want := make([]byte, rows*8)
	if _, err := colOf(300).Pack(want, src, 5*8, 1); err != nil {
		t.Fatal(err)
	}
	old := make([]byte, rows*100*8)
	for i := range old {
		old[i] = byte(i*5 + 1)
	}
	landed := func(grid []byte) []byte { // old with column 7 set to want
		exp := bytes.Clone(old)
		if _, err := colOf(100).Unpack(exp, want, 7*8, 1); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(grid, exp) {
			t.Fatal("the landed grid differs from the old one with column 7 set")
		}
		return exp
	}
	sink := &faceSink{seen: make(chan face, 3)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "faces"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "faces")
	onDev := &face{Step: 1, Col: Typed{Dev: devGrid(t, dev, src), Type: colOf(300), Base: 5 * 8, Count: 1}}
	inGo := &face{Step: 2, Col: Typed{Buf: src, Type: colOf(300), Base: 5 * 8, Count: 1}}
	request := func(m *face) face {
		t.Helper()
		if _, err := rts[0].Request(target, m, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		return <-sink.seen
	}

	// Device to device.
	dg := devGrid(t, dev, old)
	sink.dst = Typed{Dev: dg, Type: colOf(100), Base: 7 * 8, Count: 1}
	if f := request(onDev); f.Step != 1 || f.Col.Dev.Ptr() != dg.Ptr() || f.Col.Buf != nil {
		t.Fatalf("device landing: step %d, field %+v not the hook's device buffer", f.Step, f.Col)
	}
	landed(devBytes(t, dg))
	// Go memory to device.
	dg2 := devGrid(t, dev, old)
	sink.dst.Dev = dg2
	request(inGo)
	landed(devBytes(t, dg2))
	// Device to Go memory.
	hg := bytes.Clone(old)
	sink.dst = Typed{Buf: hg, Type: colOf(100), Base: 7 * 8, Count: 1}
	request(onDev)
	landed(hg)
	// Device, kept packed.
	sink.dst = Typed{}
	if f := request(onDev); f.Col.Type != datatype.Byte || !bytes.Equal(f.Col.Buf, want) {
		t.Fatalf("packed landing: type %v, equal %v", f.Col.Type, bytes.Equal(f.Col.Buf, want))
	}
	if n := rts[0].Stats().TypedDevicePacked.Load(); n != 3 {
		t.Fatalf("TypedDevicePacked = %d, want 3", n)
	}
	if n := rts[1].Stats().TypedUnpacked.Load(); n != 3 {
		t.Fatalf("TypedUnpacked = %d, want 3", n)
	}
	if sent := rts[0].Stats().TypedSent.Load(); (sent == 4) != direct {
		t.Fatalf("TypedSent %d by the protocol (direct %v)", sent, direct)
	}

	// Another signature in device memory: refused, the grid unchanged.
	f32, err := datatype.Vector(rows, 2, 200, datatype.Float32)
	if err != nil {
		t.Fatal(err)
	}
	dg3 := devGrid(t, dev, old)
	sink.dst = Typed{Dev: dg3, Type: f32, Count: 1}
	_, err = rts[0].Request(target, onDev, 10*time.Second)
	var ue *UndeliverableError
	if !errors.Is(err, transport.ErrTypeMismatch) && !errors.As(err, &ue) {
		t.Fatalf("signature mismatch: got %v", err)
	}
	if !bytes.Equal(devBytes(t, dg3), old) {
		t.Fatal("a refused device landing wrote its grid")
	}
	// A hook with both kinds of memory: undeliverable.
	sink.dst = Typed{Buf: bytes.Clone(old), Dev: dg3, Type: colOf(100), Base: 7 * 8, Count: 1}
	if _, err := rts[0].Request(target, onDev, 10*time.Second); err == nil {
		t.Fatal("a hook naming Buf and Dev took a message")
	}
	// The next message still arrives whole.
	sink.dst = Typed{}
	if f := request(onDev); !bytes.Equal(f.Col.Buf, want) {
		t.Fatal("the message after refused ones arrived damaged")
	}
	select {
	case f := <-sink.seen:
		t.Fatalf("a refused message was delivered: step %d", f.Step)
	default:
	}
}

// Bad device Typed fields fail at the sender's Send, nothing sent.
func TestTypedDeviceFieldErrors(t *testing.T) {
	dev := hostDevice(t)
	for _, path := range typedPaths {
		t.Run(path.name, func(t *testing.T) {
			rts := startLocalWith(t, 2, Options{TypedDirectMin: path.min})
			target := rts[0].PID(1, "nobody")
			col, err := datatype.Vector(512, 1, 300, datatype.Float64)
			if err != nil {
				t.Fatal(err)
			}
			grid := devGrid(t, dev, make([]byte, 512*300*8))
			bad := map[string]Typed{
				"Buf and Dev":    {Buf: make([]byte, 512*300*8), Dev: grid, Type: col, Count: 1},
				"no type":        {Dev: grid, Count: 1},
				"too small":      {Dev: devGrid(t, dev, make([]byte, 100)), Type: col, Count: 1},
				"a row too late": {Dev: grid, Type: col, Base: 300 * 8, Count: 1},
				"freed":          {Dev: freed(t, dev), Type: datatype.Byte, Count: 1},
			}
			for name, f := range bad {
				if err := Check(&face{Col: f}); err == nil {
					t.Fatalf("%s: Check passed it", name)
				}
				if err := rts[0].Send(target, &face{Col: f}); err == nil {
					t.Fatalf("%s: sent", name)
				}
			}
			// A good device field passes Check (which has no stage to pack
			// it into), and cannot be nested in a broadcast.
			good := &face{Col: Typed{Dev: grid, Type: col, Base: 299 * 8, Count: 1}}
			if err := Check(good); err != nil {
				t.Fatalf("Check of a good device field: %v", err)
			}
			if err := Check(*good); err != nil {
				t.Fatalf("Check of a good device field by value: %v", err)
			}
			if err := nestable(mustLookup(t, good)); err == nil || !strings.Contains(err.Error(), "Typed field") {
				t.Fatalf("nestable = %v, want the Typed field's refusal", err)
			}
			if n := rts[0].Stats().Sent.Load(); n != 0 {
				t.Fatalf("%d messages went out for refused sends", n)
			}
		})
	}
}

func freed(t *testing.T, dev *gpu.Device) gpu.Buffer {
	b, err := dev.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	if err := gpu.Free(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func mustLookup(t *testing.T, msg any) *codecType {
	t.Helper()
	ct, _, err := lookupType(msg)
	if err != nil {
		t.Fatal(err)
	}
	return ct
}
