package transport

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

// typedLayouts are layouts of one packed size (256 float64s) and one type
// signature: a strided vector, an indexed type with blocks out of order, a
// struct of two vectors with a gap, and a contiguous run at an offset.
func typedLayouts(t *testing.T) map[string]*datatype.Type {
	t.Helper()
	must := func(ty *datatype.Type, err error) *datatype.Type {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return ty
	}
	vec := must(datatype.Vector(64, 4, 7, datatype.Float64))
	idx := must(datatype.Indexed([]int64{100, 3, 153}, []int64{300, 0, 20}, datatype.Float64))
	half := must(datatype.Vector(32, 4, 5, datatype.Float64))
	st := must(datatype.Struct([]int64{1, 1}, []int64{16, 16 + 8*5*32 + 40}, []*datatype.Type{half, half}))
	run := must(datatype.HIndexed([]int64{256}, []int64{24}, datatype.Float64))
	return map[string]*datatype.Type{"vector": vec, "indexed": idx, "struct": st, "run": run}
}

// typedBufferSize is a buffer size that holds every typedLayouts layout.
const typedBufferSize = 8 * 500

// typedWant is what a buffer that held old holds after one element of recv
// received one element of send taken from src: datatype's Pack and Unpack
// on host memory.
func typedWant(t *testing.T, send, recv *datatype.Type, src, old []byte) []byte {
	t.Helper()
	return typedWantPrefix(t, send, recv, src, old, -1)
}

// typedWantPrefix is typedWant for a receive that took only the first
// prefix bytes of the packed message (all of them when prefix < 0).
func typedWantPrefix(t *testing.T, send, recv *datatype.Type, src, old []byte, prefix int64) []byte {
	t.Helper()
	n, err := send.PackedSize(1)
	if err != nil {
		t.Fatal(err)
	}
	packed, want := make([]byte, n), bytes.Clone(old)
	if _, err := send.Pack(packed, src, 0, 1); err != nil {
		t.Fatal(err)
	}
	if prefix >= 0 {
		packed = packed[:prefix]
	}
	if _, err := recv.UnpackRange(want, packed, 0, 1, 0); err != nil {
		t.Fatal(err)
	}
	return want
}

// faultPiece makes the device kernel that packs (or unpacks) the piece at
// packed offset off fail with err, until the test ends or testPieceKernel
// is reset.
func faultPiece(t *testing.T, unpack bool, off int64, err error) {
	testPieceKernel = func(u bool, o int64) func() error {
		if u == unpack && o == off {
			return func() error { return err }
		}
		return nil
	}
	t.Cleanup(func() { testPieceKernel = nil })
}

// TestChannelTyped sends every layout into every other, device and host
// memory on either end, over every channel variant, and checks the bytes
// against datatype's Pack and Unpack on host memory: the layout's bytes
// arrive, the gaps keep what they held, staging buffers are reused, and the
// one-run layout travels in place.
func TestChannelTyped(t *testing.T) {
	for _, v := range channelVariants {
		t.Run(v.name, func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, v.local, v.engine, v.progress)
			ctx := testCtx(t)
			a, err := ts[0].Channel(21, 1)
			if err != nil {
				t.Fatal(err)
			}
			b, err := ts[1].Channel(21, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			defer b.Close()
			layouts := typedLayouts(t)
			src := pattern(typedBufferSize, 7)
			old := pattern(typedBufferSize, 99) // what the receive buffer holds before
			runs := int64(0)
			for round := 0; round < 2; round++ {
				for sn, st := range layouts {
					for rn, rt := range layouts {
						want := typedWant(t, st, rt, src, old)
						for _, kinds := range [][2]bool{{true, true}, {true, false}, {false, true}} {
							sb, rb := typedBuf(t, sys, kinds[0], src), typedBuf(t, sys, kinds[1], old)
							rr, err := b.RecvTyped(rb, rt, 1)
							if err != nil {
								t.Fatal(err)
							}
							sr, err := a.SendTyped(sb, st, 1)
							if err != nil {
								t.Fatal(err)
							}
							if err := sr.Wait(ctx); err != nil {
								t.Fatalf("%s -> %s (device %v): send: %v", sn, rn, kinds, err)
							}
							if err := rr.Wait(ctx); err != nil {
								t.Fatalf("%s -> %s (device %v): recv: %v", sn, rn, kinds, err)
							}
							if sr.Size() != 256*8 || rr.Size() != 256*8 {
								t.Fatalf("sizes %d/%d, want %d", sr.Size(), rr.Size(), 256*8)
							}
							if got := typedRead(t, rb); !bytes.Equal(got, want) {
								t.Fatalf("%s -> %s (device %v): bytes differ from datatype's pack and unpack", sn, rn, kinds)
							}
							runs += int64(boolInt(sn == "run") + boolInt(rn == "run"))
						}
					}
				}
				if round == 0 {
					continue
				}
				// Every layout but the run packs on the device or in host memory;
				// staging buffers of the second round were the first round's.
				for i, tr := range ts {
					s := tr.ChannelTypedStats()
					t.Logf("rank %d: %+v", i, s)
					if s.DevicePacked == 0 || s.HostPacked == 0 {
						t.Fatalf("rank %d: %+v: a packing path went unused", i, s)
					}
					if s.StageAllocs > 4 {
						t.Fatalf("rank %d: %d staging buffers allocated for transfers one at a time", i, s.StageAllocs)
					}
				}
				if got := ts[0].ChannelTypedStats().Run + ts[1].ChannelTypedStats().Run; got != runs {
					t.Fatalf("%d transfers in place, want %d", got, runs)
				}
			}
		})
	}
}

// typedBuf returns a buffer holding data: device memory, or Go memory.
func typedBuf(t testing.TB, sys *gpu.System, device bool, data []byte) gpu.Buffer {
	if device {
		return devBuf(t, sys, len(data), data)
	}
	return sys.HostBuffer(bytes.Clone(data))
}

func typedRead(t *testing.T, b gpu.Buffer) []byte {
	if b.Kind().HostAccessible() {
		out, err := b.Bytes()
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	return readDev(t, b)
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestChannelTypedErrors: a receive whose layout the buffer cannot hold is
// refused before it takes a message, and the message goes to the next
// receive; a packed size other than the sender's fails the receive with a
// *SizeMismatchError, and the channel goes on.
func TestChannelTypedErrors(t *testing.T) {
	sys := hostSystem(t)
	ts := channelJob(t, false, false, ProgressDirect)
	ctx := testCtx(t)
	a, _ := ts[0].Channel(22, 1)
	b, _ := ts[1].Channel(22, 0)
	defer a.Close()
	defer b.Close()
	vec := typedLayouts(t)["vector"]
	src := pattern(typedBufferSize, 3)
	for _, device := range []bool{true, false} {
		short := typedBuf(t, sys, device, make([]byte, 100))
		if _, err := b.RecvTyped(short, vec, 1); !errors.Is(err, ErrInvalid) {
			t.Fatalf("device %v: receive into a 100-byte buffer: %v, want ErrInvalid", device, err)
		}
		if _, err := b.RecvTyped(short, vec, -1); err == nil {
			t.Fatalf("device %v: negative count accepted", device)
		}
	}
	if _, err := a.SendTyped(gpu.Buffer{}, vec, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("zero buffer: %v", err)
	}
	dst := devBuf(t, sys, typedBufferSize, nil)
	rr, err := b.RecvTyped(dst, vec, 1)
	if err != nil {
		t.Fatal(err)
	}
	sr, err := a.SendTyped(devBuf(t, sys, typedBufferSize, src), vec, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := rr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readDev(t, dst), typedWant(t, vec, vec, src, make([]byte, typedBufferSize))) {
		t.Fatal("the message after refused receives differs")
	}
	// 63 vector elements' worth received against 64 sent.
	fewer, err := datatype.Vector(63, 4, 7, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	keep := pattern(typedBufferSize, 5)
	dst = devBuf(t, sys, typedBufferSize, keep)
	rr, _ = b.RecvTyped(dst, fewer, 1)
	sr, _ = a.SendTyped(devBuf(t, sys, typedBufferSize, src), vec, 1)
	var sm *SizeMismatchError
	if err := rr.Wait(ctx); !errors.As(err, &sm) {
		t.Fatalf("receive of 63 vector elements from 64: %v, want *SizeMismatchError", err)
	}
	if err := sr.Wait(ctx); err != nil {
		t.Fatalf("sender: %v", err)
	}
	if !bytes.Equal(readDev(t, dst), keep) {
		t.Fatal("a failed typed receive wrote its buffer")
	}
}

// TestChannelTypedPieceFault: a channel transfer of a device layout over
// three chunks in pinned staging whose second chunk's pack kernel, or
// unpack kernel, faults fails on the end of the fault with it. A send's
// fault sends the chunks from there empty, which the receiver reports as a
// size mismatch, not a wait; an unpack's fault still takes every chunk, so
// the sender completes. Either way the receiver's layout holds the first
// chunk, unpacked as it landed, and nothing after it, and the next
// transfers go through on a new stream.
func TestChannelTypedPieceFault(t *testing.T) {
	for _, unpackFault := range []bool{false, true} {
		t.Run(map[bool]string{false: "pack", true: "unpack"}[unpackFault], func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, false, false, ProgressDirect)
			ctx := testCtx(t)
			vec, chans := threeChunkChannels(t, ts, 41)
			size := int(vec.Extent())
			boom := errors.New("injected kernel fault")
			faultPiece(t, unpackFault, ChannelChunkSize, boom)
			src, old := pattern(size, 81), pattern(size, 82)
			transfer := func() (send, recv error, rb gpu.Buffer) {
				t.Helper()
				rb = devBuf(t, sys, size, old)
				rr, err := chans[1].RecvTyped(rb, vec, 1)
				if err != nil {
					t.Fatal(err)
				}
				sr, err := chans[0].SendTyped(devBuf(t, sys, size, src), vec, 1)
				if err != nil {
					t.Fatal(err)
				}
				return sr.Wait(ctx), rr.Wait(ctx), rb
			}
			var pipelined [2]int64
			for i, tr := range ts {
				pipelined[i] = tr.ChannelTypedStats().Pipelined
			}
			serr, rerr, rb := transfer()
			testPieceKernel = nil
			if unpackFault {
				if serr != nil || !errors.Is(rerr, boom) {
					t.Fatalf("transfer whose unpack faulted: send %v (want nil), recv %v (want the fault)", serr, rerr)
				}
			} else {
				if !errors.Is(serr, boom) {
					t.Fatalf("send with a faulting pack kernel: %v, want the fault", serr)
				}
				if !errors.Is(rerr, ErrSizeMismatch) {
					t.Fatalf("recv of a send whose packing faulted: %v, want ErrSizeMismatch", rerr)
				}
			}
			if !bytes.Equal(readDev(t, rb), typedWantPrefix(t, vec, vec, src, old, ChannelChunkSize)) {
				t.Fatal("the receiver's device layout does not hold exactly the first chunk")
			}
			for i := range 2 {
				serr, rerr, rb := transfer()
				if serr != nil || rerr != nil {
					t.Fatalf("transfer %d after the fault: send %v, recv %v", i, serr, rerr)
				}
				if !bytes.Equal(readDev(t, rb), typedWant(t, vec, vec, src, old)) {
					t.Fatalf("transfer %d after the fault: bytes differ", i)
				}
			}
			// Every send was pipelined; the receives that succeeded were.
			for i, want := range []int64{3, 2} {
				if got := ts[i].ChannelTypedStats().Pipelined - pipelined[i]; got != want {
					t.Fatalf("rank %d: %d pipelined channel transfers, want %d", i, got, want)
				}
			}
		})
	}
}

// TestChannelTypedRecvPipelined: a channel receive of a device layout over
// three chunks in pinned staging unpacks each chunk as it lands. The
// sender's pack of its last chunk waits, on its stream, until the receiver
// has enqueued the unpack of its first, so the transfer completes only if
// the receive unpacks before the message is all in; the bytes are exact.
func TestChannelTypedRecvPipelined(t *testing.T) {
	for _, v := range []struct {
		name   string
		engine bool
		mode   ProgressMode
	}{{"direct", false, ProgressDirect}, {"queue", false, ProgressQueue}, {"engine", true, ProgressDirect}} {
		t.Run(v.name, func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, false, v.engine, v.mode)
			ctx := testCtx(t)
			vec, chans := threeChunkChannels(t, ts, 42)
			size := int(vec.Extent())
			gate, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			first := make(chan struct{})
			var once sync.Once
			testPieceKernel = func(unpack bool, off int64) func() error {
				switch {
				case unpack && off == 0:
					once.Do(func() { close(first) })
				case !unpack && off == 2*ChannelChunkSize:
					return func() error {
						select {
						case <-first:
							return nil
						case <-gate.Done():
							return errors.New("the receive unpacked no chunk before the sender packed its last")
						}
					}
				}
				return nil
			}
			t.Cleanup(func() { testPieceKernel = nil })
			src, old := pattern(size, 91), pattern(size, 92)
			rb := devBuf(t, sys, size, old)
			rr, err := chans[1].RecvTyped(rb, vec, 1)
			if err != nil {
				t.Fatal(err)
			}
			sent := make(chan error, 1)
			sb := devBuf(t, sys, size, src) // allocated here: devBuf may t.Fatal
			go func() {
				sr, err := chans[0].SendTyped(sb, vec, 1)
				if err == nil {
					err = sr.Wait(ctx)
				}
				sent <- err
			}()
			rerr := rr.Wait(ctx)
			if serr := <-sent; serr != nil || rerr != nil {
				t.Fatalf("send %v, recv %v", serr, rerr)
			}
			if !bytes.Equal(readDev(t, rb), typedWant(t, vec, vec, src, old)) {
				t.Fatal("bytes differ")
			}
			if got := ts[1].ChannelTypedStats().Pipelined; got != 1 {
				t.Fatalf("%d pipelined receives, want 1", got)
			}
		})
	}
}

// threeChunkChannels opens channel id between the two ranks of ts and
// returns it with a device vector whose packed size (1.5 MiB of 64-byte
// blocks) takes three channel chunks.
func threeChunkChannels(t *testing.T, ts []*Transport, id uint32) (*datatype.Type, [2]*Channel) {
	t.Helper()
	vec, err := datatype.Vector(3*ChannelChunkSize/64, 8, 16, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	var chans [2]*Channel
	for i, tr := range ts {
		if chans[i], err = tr.Channel(id, 1-i); err != nil {
			t.Fatal(err)
		}
	}
	return vec, chans
}
