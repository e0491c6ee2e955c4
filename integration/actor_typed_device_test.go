package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/datatype/layouts"
	"github.com/troupe-hpc/troupe/gpu"
)

// Typed fields in device memory between real processes (issues 5 and 6):
// every layout of shared/ddt-layouts.md of at most devTypedMaxAlloc bytes
// goes from device memory on rank 0 (Typed.Dev) into device memory on rank
// 1, in the same layout and in a contiguous array of the same signature,
// packed into the active message and by the typed-transfer protocol.

func init() {
	scenarios["actor-typed-device/packed"] = actorTypedDevice(-1)
	scenarios["actor-typed-device/protocol"] = actorTypedDevice(1)
}

// devTypedMaxAlloc leaves out the nas_mg layouts (273 MB each).
const devTypedMaxAlloc = 16 << 20

// devTypedSink lands each message in device memory where the last
// expectTyped said and checks it there.
type devTypedSink struct {
	sys  *gpu.System
	mu   sync.Mutex
	dst  actor.Typed // Dev set
	want []byte      // dst.Dev's bytes as they must be afterwards
}

func (s *devTypedSink) PostReceiveTyped(*actor.Incoming) actor.Typed {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dst
}

func (s *devTypedSink) Receive(c pa.Context) {
	switch m := c.Message().(type) {
	case *expectTyped:
		c.Respond(&typedVerdict{Err: s.expect(m)})
	case *typedLayoutMsg:
		c.Respond(&typedVerdict{Err: s.check(m)})
	}
}

func (s *devTypedSink) expect(m *expectTyped) string {
	l, err := layouts.Build(m.Layout)
	if err != nil {
		return err.Error()
	}
	src := make([]byte, l.Alloc)
	layouts.Fill(src, l.Base)
	packed := make([]byte, l.Packed)
	if _, err := l.Type.Pack(packed, src, l.Base, 1); err != nil {
		return err.Error()
	}
	rt, alloc, base, err := recvLayout(l, m.Variant)
	if err != nil {
		return err.Error()
	}
	want := make([]byte, alloc)
	fillSentinel(want)
	old := append([]byte(nil), want...)
	if _, err := rt.Unpack(want, packed, base, 1); err != nil {
		return fmt.Sprintf("reference unpack: %v", err)
	}
	buf, err := devWith(s.sys, old)
	if err != nil {
		return err.Error()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.dst.Dev.IsZero() {
		_ = gpu.Free(s.dst.Dev)
	}
	s.dst, s.want = actor.Typed{Dev: buf, Type: rt, Base: base, Count: 1}, want
	return ""
}

func (s *devTypedSink) check(m *typedLayoutMsg) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	what := m.Layout + "/" + m.Variant
	if m.Data.Dev.Ptr() != s.dst.Dev.Ptr() || m.Data.Buf != nil {
		return what + ": the field is not the hook's device buffer"
	}
	got := make([]byte, s.dst.Dev.Len())
	if err := gpu.CopyToHost(got, s.dst.Dev); err != nil {
		return what + ": " + err.Error()
	}
	if d := diff(got, s.want); d != "" {
		return what + ": " + d
	}
	return ""
}

// actorTypedDevice sends the layouts from rank 0's device memory to rank
// 1's sink, Typed fields going by the protocol from typedMin bytes.
func actorTypedDevice(typedMin int) scenario {
	return func(ctx context.Context, r *rank) error {
		sys, err := openGPU(r)
		if err != nil {
			return err
		}
		defer sys.Close()
		return withActors(ctx, r, actor.Options{TypedDirectMin: typedMin}, func(rt *actor.Runtime) error {
			if r.id() == 1 {
				sink := &devTypedSink{sys: sys}
				if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return sink }), "devtypedsink"); err != nil {
					return err
				}
			}
			if err := r.b.Barrier(ctx, "actor-typed-device.spawned"); err != nil {
				return err
			}
			n := 0
			if r.id() == 0 {
				sink := rt.PID(1, "devtypedsink")
				ask := func(msg any) error {
					res, err := rt.Request(sink, msg, actorTimeout)
					if err != nil {
						return err
					}
					if v, ok := res.(*typedVerdict); !ok || v.Err != "" {
						return fmt.Errorf("sink: %#v", res)
					}
					return nil
				}
				for _, name := range layouts.Names {
					l, err := layouts.Build(name)
					if err != nil {
						return err
					}
					if l.Alloc > devTypedMaxAlloc {
						continue
					}
					host := make([]byte, l.Alloc)
					layouts.Fill(host, l.Base)
					src, err := devWith(sys, host)
					if err != nil {
						return err
					}
					for _, v := range []string{"same", "contig"} {
						if err := ask(&expectTyped{Layout: name, Variant: v}); err != nil {
							return fmt.Errorf("%s/%s: %w", name, v, err)
						}
						msg := &typedLayoutMsg{Layout: name, Variant: v, Data: actor.Typed{Dev: src, Type: l.Type, Base: l.Base, Count: 1}}
						if err := ask(msg); err != nil {
							return fmt.Errorf("%s/%s: %w", name, v, err)
						}
						n++
					}
					if err := gpu.Free(src); err != nil {
						return err
					}
				}
			}
			if err := r.b.Barrier(ctx, "actor-typed-device.sent"); err != nil {
				return err
			}
			st := rt.Stats()
			if r.id() == 0 {
				r.logf("%d device Typed messages delivered intact; %d packed from device memory, %d by the protocol",
					n, st.TypedDevicePacked.Load(), st.TypedSent.Load())
				if st.TypedDevicePacked.Load() != uint64(n) || (typedMin > 0) != (st.TypedSent.Load() == uint64(n)) {
					return fmt.Errorf("counters: %d packed from the device, %d by the protocol, of %d", st.TypedDevicePacked.Load(), st.TypedSent.Load(), n)
				}
			}
			return nil
		})
	}
}

// devTypedMessages is how many messages actorTypedDevice sends.
func devTypedMessages(t *testing.T) int {
	n := 0
	for _, name := range layouts.Names {
		l, err := layouts.Build(name)
		if err != nil {
			t.Fatal(err)
		}
		if l.Alloc <= devTypedMaxAlloc {
			n += 2
		}
	}
	return n
}

func TestActorTypedDeviceFields(t *testing.T) {
	for _, path := range []string{"packed", "protocol"} {
		t.Run(path, func(t *testing.T) {
			forActorTLS(t, func(t *testing.T, c cfg) {
				res := runJob(t, "actor-typed-device/"+path, 2, c)
				requireLine(t, res, fmt.Sprintf("[0] rank 0: %d device Typed messages delivered intact", devTypedMessages(t)))
			})
		})
	}
}

// TestActorTypedDeviceFieldsCUDA: the same on the cuda backend (this
// machine's GPU, else the test driver), where device layouts are packed and
// unpacked by gpupack's kernels.
func TestActorTypedDeviceFieldsCUDA(t *testing.T) {
	useCUDA(t)
	res := runJob(t, "actor-typed-device/protocol", 2, cfg{"shm", "direct"})
	requireLines(t, res, "[0] rank 0: gpu backend cuda",
		fmt.Sprintf("[0] rank 0: %d device Typed messages delivered intact", devTypedMessages(t)))
}
