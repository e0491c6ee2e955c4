package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	dt "github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/datatype/layouts"
	"github.com/troupe-hpc/troupe/transport"
)

// Typed fields of actor messages between real processes (issue 5, "as fields
// of actor messages"): every layout of shared/ddt-layouts.md goes from rank 0
// to an actor on rank 1 that lands it in the same layout, in a contiguous
// array of the same signature (through its PostReceiveTyped hook), or keeps
// the packed stream (no hook). Along both paths: packed into the active
// message, and by the transport's typed-transfer protocol with the adaptive
// default (each message three times, so that it sees layouts registered)
// and with SGL and zero-copy windows forced (TROUPE_NC_SCHEME).

func init() {
	actor.MustRegister[expectTyped]()
	actor.MustRegister[typedLayoutMsg]()
	actor.MustRegister[typedVerdict]()
	scenarios["actor-typed/packed"] = actorTyped(-1)
	scenarios["actor-typed/protocol"] = actorTyped(1)
	actor.MustRegister[typedSizeMsg]()
	scenarios["actor-typed/default"] = actorTypedDefault
}

// expectTyped tells the sink how to land the next Typed message.
type expectTyped struct{ Layout, Variant string }

// typedLayoutMsg carries one layout's elements.
type typedLayoutMsg struct {
	Layout, Variant string
	Data            actor.Typed
}

// typedVerdict is the sink's answer: "" or what was wrong.
type typedVerdict struct{ Err string }

// typedSink lands each message where the last expectTyped said and checks
// it. The hook runs on the progress goroutine, Receive on the actor's.
type typedSink struct {
	mu     sync.Mutex
	dst    actor.Typed       // where the next message lands (nil Type: packed)
	want   []byte            // dst.Buf as it must be afterwards, or the packed bytes
	packed map[string][]byte // each layout's packed bytes, made once
	// Memory reused from layout to layout: the nas_mg layouts span 273 MB,
	// and touching that much fresh memory takes seconds on some virtual
	// machines (1.5-3 s for 273 MB on the 2-vCPU development VM).
	srcMem, wantMem, dstMem []byte
}

// reuse returns (*mem)[:n], growing *mem when it is shorter.
func reuse(mem *[]byte, n int64) []byte {
	if int64(cap(*mem)) < n {
		*mem = make([]byte, n)
	}
	return (*mem)[:n]
}

func (s *typedSink) PostReceiveTyped(*actor.Incoming) actor.Typed {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dst
}

func (s *typedSink) Receive(c pa.Context) {
	switch m := c.Message().(type) {
	case *expectTyped:
		c.Respond(&typedVerdict{Err: s.expect(m)})
	case *typedLayoutMsg:
		c.Respond(&typedVerdict{Err: s.check(m)})
	}
}

func (s *typedSink) expect(m *expectTyped) string {
	l, err := layouts.Build(m.Layout)
	if err != nil {
		return err.Error()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	packed := s.packed[m.Layout]
	if packed == nil {
		packed = make([]byte, l.Packed)
		src := reuse(&s.srcMem, l.Alloc)
		layouts.Fill(src, l.Base)
		if _, err := l.Type.Pack(packed, src, l.Base, 1); err != nil {
			return err.Error()
		}
		if s.packed == nil {
			s.packed = map[string][]byte{}
		}
		s.packed[m.Layout] = packed
	}
	if m.Variant == "packed" {
		s.dst, s.want = actor.Typed{}, packed
		return ""
	}
	rt, alloc, base, err := recvLayout(l, m.Variant)
	if err != nil {
		return err.Error()
	}
	want := reuse(&s.wantMem, alloc)
	fillSentinel(want)
	if _, err := rt.Unpack(want, packed, base, 1); err != nil {
		return fmt.Sprintf("reference unpack: %v", err)
	}
	buf := reuse(&s.dstMem, alloc)
	fillSentinel(buf)
	s.dst, s.want = actor.Typed{Buf: buf, Type: rt, Base: base, Count: 1}, want
	return ""
}

func (s *typedSink) check(m *typedLayoutMsg) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	what := m.Layout + "/" + m.Variant
	if s.dst.Type == nil {
		if m.Data.Type != dt.Byte || m.Data.Count != int64(len(s.want)) {
			return fmt.Sprintf("%s: packed field of type %v, count %d, want %d bytes", what, m.Data.Type, m.Data.Count, len(s.want))
		}
		if d := diff(m.Data.Buf, s.want); d != "" {
			return what + ": " + d
		}
		return ""
	}
	if len(m.Data.Buf) == 0 || &m.Data.Buf[0] != &s.dst.Buf[0] {
		return what + ": the field is not the hook's buffer"
	}
	if d := diff(s.dst.Buf, s.want); d != "" {
		return what + ": " + d
	}
	return ""
}

// actorTyped sends every layout in every landing variant from rank 0 to
// rank 1's sink, Typed fields going by the protocol from typedMin bytes.
func actorTyped(typedMin int) scenario {
	return func(ctx context.Context, r *rank) error {
		return withActors(ctx, r, actor.Options{TypedDirectMin: typedMin}, func(rt *actor.Runtime) error {
			if r.id() == 1 {
				props := rt.Props(func() pa.Actor { return &typedSink{} })
				if _, err := rt.Root().SpawnNamed(props, "typedsink"); err != nil {
					return err
				}
			}
			if err := r.b.Barrier(ctx, "actor-typed.spawned"); err != nil {
				return err
			}
			o, err := transport.NoncontigOptionsFromEnv(transport.DefaultNoncontigOptions())
			if err != nil {
				return err
			}
			n, reps := 0, 1
			if typedMin > 0 && o.Scheme == dt.SchemeAuto {
				reps = 3
			}
			if r.id() == 0 {
				sink := rt.PID(1, "typedsink")
				timeout := actorTimeout
				if raceEnabled {
					// The sink checks every byte of a 273 MB nas_mg
					// layout: under the race detector on a 2-vCPU
					// machine that alone took 10-20 s.
					timeout = 3 * actorTimeout
				}
				ask := func(msg any) error {
					res, err := rt.Request(sink, msg, timeout)
					if err != nil {
						return err
					}
					if v, ok := res.(*typedVerdict); !ok || v.Err != "" {
						return fmt.Errorf("sink: %#v", res)
					}
					return nil
				}
				var srcMem []byte // reused: see typedSink
				for _, name := range layouts.Names {
					l, err := layouts.Build(name)
					if err != nil {
						return err
					}
					src := reuse(&srcMem, l.Alloc)
					layouts.Fill(src, l.Base)
					for _, v := range []string{"same", "contig", "packed"} {
						if err := ask(&expectTyped{Layout: name, Variant: v}); err != nil {
							return fmt.Errorf("%s/%s: %w", name, v, err)
						}
						msg := &typedLayoutMsg{Layout: name, Variant: v, Data: actor.Typed{Buf: src, Type: l.Type, Base: l.Base, Count: 1}}
						for range reps {
							if err := ask(msg); err != nil {
								return fmt.Errorf("%s/%s: %w", name, v, err)
							}
							n++
						}
					}
				}
			}
			if err := r.b.Barrier(ctx, "actor-typed.sent"); err != nil {
				return err
			}
			st := rt.Stats()
			nc := rt.Transport().NoncontigStats()
			switch {
			case r.id() == 0:
				r.logf("%d Typed messages delivered intact; %d by the protocol, schemes %+v", n, st.TypedSent.Load(), nc.Sent)
				if typedMin > 0 && st.TypedSent.Load() != uint64(n) {
					return fmt.Errorf("%d of %d Typed fields went by the protocol", st.TypedSent.Load(), n)
				}
				forced := map[dt.Scheme]int64{dt.SchemePack: nc.Sent.Pack, dt.SchemeSGL: nc.Sent.SGL, dt.SchemeZCopy: nc.Sent.ZCopy}
				if c, ok := forced[o.Scheme]; ok && typedMin > 0 && c != int64(n) {
					return fmt.Errorf("%d of %d transfers used the forced scheme %v: %+v", c, n, o.Scheme, nc.Sent)
				}
			case r.id() == 1 && typedMin < 0 && st.TypedReceived.Load() != 0:
				return fmt.Errorf("%d Typed fields went by the protocol with it off", st.TypedReceived.Load())
			}
			return nil
		})
	}
}

func TestActorTypedFields(t *testing.T) {
	for _, path := range []struct{ name, scenario, scheme string }{
		{"packed", "packed", ""},
		{"protocol", "protocol", ""},
		{"protocol-sgl", "protocol", "sgl"},
		{"protocol-zcopy", "protocol", "zcopy"},
	} {
		t.Run(path.name, func(t *testing.T) {
			if path.scheme != "" {
				t.Setenv("TROUPE_NC_SCHEME", path.scheme)
			}
			life := rankTimeout
			if raceEnabled {
				// The nas_mg layouts span 273 MB: building, filling and
				// checking them under the race detector takes 30-60 s on a
				// 2-vCPU machine.
				life = 3 * rankTimeout
			}
			forActorTLS(t, func(t *testing.T, c cfg) {
				res := runJobFor(t, "actor-typed/"+path.scenario, 2, c, life)
				n := len(layouts.Names) * 3
				if path.name == "protocol" {
					n *= 3 // the adaptive default sees each layout three times
				}
				requireLine(t, res, fmt.Sprintf("[0] rank 0: %d Typed messages delivered intact", n))
			})
		})
	}
}

// typedSizeMsg carries a Typed field of N packed bytes (512-byte blocks of a
// stride of 1 KiB over a pattern).
type typedSizeMsg struct {
	N    int
	Data actor.Typed
}

// typedSizeSrc is the pattern typedSizeMsg's blocks are taken from.
func typedSizeSrc(n int) []byte {
	src := make([]byte, 2*n)
	for i := range src {
		src[i] = byte(i * 5)
	}
	return src
}

// actorTypedDefault: with Options.TypedDirectMin left at its default, rank
// 0 sends rank 1 Typed fields just below and at the threshold for rank 1
// (actor.DefaultTypedDirectMinCMA when it is another process reached by
// cross-memory attach, else actor.DefaultTypedDirectMin); only the second
// may go by the protocol, and both arrive intact (kept packed, no hook).
func actorTypedDefault(ctx context.Context, r *rank) error {
	return withActors(ctx, r, actor.Options{}, func(rt *actor.Runtime) error {
		if r.id() == 1 {
			_, err := spawn(rt, "typedsize", func(c pa.Context) {
				m, ok := c.Message().(*typedSizeMsg)
				if !ok {
					return
				}
				verdict := ""
				src := typedSizeSrc(m.N)
				for i, b := range m.Data.Buf {
					if b != src[i/512*1024+i%512] {
						verdict = fmt.Sprintf("byte %d of %d differs", i, m.N)
						break
					}
				}
				if len(m.Data.Buf) != m.N {
					verdict = fmt.Sprintf("%d bytes arrived for %d", len(m.Data.Buf), m.N)
				}
				c.Respond(&typedVerdict{Err: verdict})
			})
			if err != nil {
				return err
			}
		}
		if err := r.b.Barrier(ctx, "actor-typed-default.spawned"); err != nil {
			return err
		}
		if r.id() != 0 {
			return nil
		}
		tr := rt.Transport()
		threshold := actor.DefaultTypedDirectMin
		if tr.CMAPeer(1) && !tr.SameProcess(1) {
			threshold = actor.DefaultTypedDirectMinCMA
		}
		for _, n := range []int{threshold - 512, threshold} {
			ty, err := dt.Vector(int64(n/512), 512, 1024, dt.Byte)
			if err != nil {
				return err
			}
			before := rt.Stats().TypedSent.Load()
			res, err := rt.Request(rt.PID(1, "typedsize"), &typedSizeMsg{N: n, Data: actor.Typed{Buf: typedSizeSrc(n), Type: ty, Count: 1}}, actorTimeout)
			if err != nil {
				return fmt.Errorf("%d packed bytes: %w", n, err)
			}
			if v, ok := res.(*typedVerdict); !ok || v.Err != "" {
				return fmt.Errorf("%d packed bytes: sink: %#v", n, res)
			}
			want := uint64(0)
			if n >= threshold {
				want = 1
			}
			if got := rt.Stats().TypedSent.Load() - before; got != want {
				return fmt.Errorf("a field of %d packed bytes (threshold %d): %d went by the protocol, want %d", n, threshold, got, want)
			}
		}
		r.logf("Typed threshold %d (CMA peer %v): below it packed, from it by the protocol", threshold, tr.CMAPeer(1))
		return nil
	})
}

// TestActorTypedDefault: the default threshold between processes is the
// CMA one over shared memory (where cross-memory attach works) and the
// network one over TCP.
func TestActorTypedDefault(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "actor-typed/default", 2, c)
		want := fmt.Sprintf("[0] rank 0: Typed threshold %d (CMA peer false)", actor.DefaultTypedDirectMin)
		if c.tls == "shm" {
			want = fmt.Sprintf("[0] rank 0: Typed threshold %d (CMA peer true)", actor.DefaultTypedDirectMinCMA)
			if !strings.Contains(res.stdout, want) && strings.Contains(res.stdout, "CMA peer false") {
				t.Skipf("cross-memory attach is not usable between the ranks on this machine, so only the network threshold was exercised:\n%s", res.stdout)
			}
		}
		requireLine(t, res, want)
	})
}
