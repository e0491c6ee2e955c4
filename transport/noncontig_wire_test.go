package transport

import (
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
