package transport

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// Every RTS field survives encode and decode, the round trip included, and
// malformed headers are refused with ErrInvalid.
func TestRTSWire(t *testing.T) {
	in := rts{proposal: datatype.SchemeSGL, flags: rtsCrossover, xid: 77, bytes: 65536,
		sig:      datatype.Signature{Elements: 8192, Hash: [2]uint64{0x0123456789abcdef, 0xfedcba9876543210}},
		minBlock: 4096, segments: 16, chunk: 131072, rtt: 2345}
	b := make([]byte, rtsHdrLen)
	in.encode(b)
	var out rts
	if err := out.decode(b); err != nil {
		t.Fatal(err)
	}
	if out != in {
		t.Fatalf("decoded %+v, want %+v", out, in)
	}
	inline := in
	inline.proposal, inline.flags, inline.bytes = datatype.SchemePack, rtsInline, 3
	ib := make([]byte, rtsHdrLen+3)
	inline.encode(ib)
	if err := out.decode(ib); err != nil || out != inline {
		t.Fatalf("inline RTS: %+v, %v", out, err)
	}
	bad := func(name string, b []byte) {
		t.Helper()
		var m rts
		if err := m.decode(b); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: decode error %v, want ErrInvalid", name, err)
		}
	}
	bad("short", b[:rtsHdrLen-1])
	old := append([]byte(nil), b...)
	old[0] = 1 // the version before the round trip field
	bad("version 1", old)
	scheme := append([]byte(nil), b...)
	scheme[1] = 9
	bad("unknown scheme", scheme)
	bad("inline length", ib[:rtsHdrLen+2])
}

func TestNoteRTT(t *testing.T) {
	nc := &noncontig{rtts: make([]atomic.Uint32, 4)}
	if nc.rtt(3) != 0 {
		t.Fatal("round trip known before any was noted")
	}
	nc.noteRTT(3, 2500*time.Nanosecond)
	if got := nc.rtt(3); got != 2500 {
		t.Fatalf("rtt %d, want 2500", got)
	}
	nc.noteRTT(3, time.Hour) // beyond 32 bits of nanoseconds: clamped, not wrapped
	if got := nc.rtt(3); got != math.MaxUint32 {
		t.Fatalf("rtt %d after an hour, want the 32-bit maximum", got)
	}
	nc.noteRTT(3, -time.Second)
	if got := nc.rtt(3); got != 0 {
		t.Fatalf("rtt %d for a negative duration, want 0", got)
	}
}

// The verdict maps are bounded: past four entries per kept layout a map
// starts over rather than growing.
func TestVerdictMapsBounded(t *testing.T) {
	nc := &noncontig{opts: NoncontigOptions{MaxLayouts: 2}, sentVerdicts: map[crossKey]keptVerdict{},
		shapeVerdicts: map[shapeKey]keptVerdict{}}
	for i := range 20 {
		k := crossKey{peer: 1, minBlock: int64(i + 1), segments: 2, bytes: 64}
		nc.noteSentVerdict(k, datatype.SchemePack)
		nc.noteShapeVerdict(shapeKey{crossKey: k, minBlock: 8, segments: 2}, datatype.SchemeSGL)
		if len(nc.sentVerdicts) > 8 || len(nc.shapeVerdicts) > 8 {
			t.Fatalf("after %d verdicts: %d sent, %d shape entries, want at most 8", i+1, len(nc.sentVerdicts), len(nc.shapeVerdicts))
		}
		if v, ok := nc.sentVerdict(k); !ok || v != datatype.SchemePack {
			t.Fatalf("the newest sent verdict is gone: %v %v", v, ok)
		}
		if v, ok := nc.shapeVerdict(shapeKey{crossKey: k, minBlock: 8, segments: 2}); !ok || v != datatype.SchemeSGL {
			t.Fatalf("the newest shape verdict is gone: %v %v", v, ok)
		}
	}
}

// The TROUPE_NC_* variables reach the options, and a value that does not
// parse is refused with ErrInvalid naming the variable.
func TestNoncontigOptionsFromEnv(t *testing.T) {
	t.Setenv("TROUPE_NC_T", "4096")
	t.Setenv("TROUPE_NC_CROSSOVER_TRIALS", "5")
	t.Setenv("TROUPE_NC_CROSSOVER_RUN", "3")
	t.Setenv("TROUPE_NC_CROSSOVER_REUSE", "250ms")
	t.Setenv("TROUPE_NC_SCHEME", "sgl")
	o, err := NoncontigOptionsFromEnv(DefaultNoncontigOptions())
	if err != nil {
		t.Fatal(err)
	}
	th := o.Thresholds
	if th.ZCopyAvgBlock != 4096 || th.CrossoverTrials != 5 || th.CrossoverRun != 3 || th.CrossoverReuse != 250*time.Millisecond || o.Scheme != datatype.SchemeSGL {
		t.Fatalf("options from the environment: T %d, trials %d, run %d, reuse %v, scheme %v", th.ZCopyAvgBlock, th.CrossoverTrials, th.CrossoverRun, th.CrossoverReuse, o.Scheme)
	}
	for name, bad := range map[string]string{"TROUPE_NC_CROSSOVER_REUSE": "soon", "TROUPE_NC_T": "8k", "TROUPE_NC_PACK_DEPTH": "x"} {
		t.Run(name, func(t *testing.T) {
			t.Setenv(name, bad)
			_, err := NoncontigOptionsFromEnv(DefaultNoncontigOptions())
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), name) {
				t.Fatalf("%s=%q: error %v, want ErrInvalid naming it", name, bad, err)
			}
		})
	}
	t.Setenv("TROUPE_NC_CROSSOVER_REUSE", "-1s")
	if _, err := NoncontigOptionsFromEnv(DefaultNoncontigOptions()); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "CrossoverReuse") {
		t.Fatalf("a negative reuse time: error %v, want ErrInvalid naming CrossoverReuse", err)
	}
}

// TestNoncontigOptionsBounds: option values that passed Validate and then
// broke transfers are refused. A PackChunk above what a receiver accepts in
// an RTS left every typed send waiting for an answer; a huge PackDepth
// panicked the receiving rank (makeslice); counts allocated up front and
// the bounce buffers' memory are bounded too.
func TestNoncontigOptionsBounds(t *testing.T) {
	for name, set := range map[string]func(*NoncontigOptions){
		"PackChunk above the wire's": func(o *NoncontigOptions) { o.PackChunk = maxWireChunk + 1 },
		"PackDepth":                  func(o *NoncontigOptions) { o.PackDepth = 1 << 62 },
		"PackBuffers":                func(o *NoncontigOptions) { o.PackBuffers = ncMaxCount + 1 },
		"PackWorkers":                func(o *NoncontigOptions) { o.PackWorkers = ncMaxCount + 1 },
		"KeyPool":                    func(o *NoncontigOptions) { o.KeyPool = 1e9 },
		"MaxLayouts":                 func(o *NoncontigOptions) { o.MaxLayouts = ncMaxLayouts + 1 },
		"bounce memory":              func(o *NoncontigOptions) { o.PackBuffers, o.PackChunk = 1<<12, 1<<30 },
	} {
		o := DefaultNoncontigOptions()
		set(&o)
		if err := o.Validate(); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %+v passed Validate (%v)", name, o, err)
		}
	}
	o := DefaultNoncontigOptions()
	o.PackChunk, o.PackDepth, o.KeyPool = maxWireChunk, ncMaxCount, ncMaxCount
	if err := o.Validate(); err != nil {
		t.Fatalf("the largest values allowed: %v", err)
	}
}

// TestTypedMalformedRTSFailsBothSides: a receiver that cannot decode an RTS
// whose transfer id it can read answers the sender with a failure, which
// waited for an answer for ever before. The RTS is made malformed by
// setting the sender's options behind Validate's back. (A pack transfer
// whose chunks follow its RTS unasked still leaves them waiting for a
// receiver: their size is what the receiver could not read.)
func TestTypedMalformedRTSFailsBothSides(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	nc, err := ts[0].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	nc.opts.PackChunk = maxWireChunk + 1
	dt, err := datatype.Contiguous(16, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		n      int64
		scheme datatype.Scheme
	}{{1, datatype.SchemePack}, {64 << 10, datatype.SchemeSGL}} { // pack inline; SGL waits for its CTS
		v, err := datatype.Contiguous(c.n, dt)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 16*c.n)
		sr, err := ts[0].IsendTypedWith(1, 3, pattern(len(buf), 1), v, 1, TypedOptions{Scheme: c.scheme})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ts[1].RecvTyped(ctx, 0, 3, buf, v, 1); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%d bytes: receive of a malformed RTS: %v, want ErrInvalid", len(buf), err)
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err = sr.Wait(wctx)
		cancel()
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("%d bytes: the sender of a malformed RTS: %v, want the receiver's failure", len(buf), err)
		}
	}
}

// TestTypedProbeMalformedRTSFailsBothSides: a typed probe that receives an
// RTS it cannot decode answers the sender with a failure, as a receive
// does (TestTypedMalformedRTSFailsBothSides): MprobeTyped, ImprobeTyped
// and ProbeTyped failed on such an RTS and left its sender waiting for
// ever, and a receive that then took the message ProbeTyped had parked
// failed without answering it either.
func TestTypedProbeMalformedRTSFailsBothSides(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	nc, err := ts[0].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	nc.opts.PackChunk = maxWireChunk + 1 // behind Validate's back: the RTS is malformed
	dt, err := datatype.Contiguous(16, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	probes := map[string]func(tag int) error{
		"MprobeTyped": func(tag int) error {
			_, err := ts[1].MprobeTyped(ctx, 0, tag)
			return err
		},
		"ImprobeTyped": func(tag int) error {
			for ctx.Err() == nil {
				if _, ok, err := ts[1].ImprobeTyped(0, tag); err != nil || ok {
					return err
				}
			}
			return ctx.Err()
		},
		"ProbeTyped then RecvTyped": func(tag int) error {
			if _, err := ts[1].ProbeTyped(ctx, 0, tag); !errors.Is(err, ErrInvalid) {
				return err
			}
			_, err := ts[1].RecvTyped(ctx, 0, tag, make([]byte, 16), dt, 1)
			return err
		},
	}
	tag := 3
	for name, probe := range probes {
		tag++
		sr, err := ts[0].IsendTyped(1, tag, pattern(16, tag), dt, 1)
		if err != nil {
			t.Fatal(err)
		}
		if err := probe(tag); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%s of a malformed RTS: %v, want ErrInvalid", name, err)
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err = sr.Wait(wctx)
		cancel()
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("%s: the sender of a malformed RTS: %v, want the receiver's failure", name, err)
		}
	}
}
