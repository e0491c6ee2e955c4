package transport

import (
	"fmt"
	"testing"

	"pgregory.net/rapid"
)

// counterKinds are the kinds laid out kind(4) | source(32) | counter(28).
var counterKinds = []Kind{KindDevice, KindDDT, KindCtrl}

func TestTagLayoutConstants(t *testing.T) {
	if 4+SourceBits+CounterBits != 64 {
		t.Errorf("DEVICE/DDT/CTRL layout uses %d bits, want 64", 4+SourceBits+CounterBits)
	}
	if 4+ChannelBits+ChannelCounterBits != 64 {
		t.Errorf("CHANNEL layout uses %d bits, want 64", 4+ChannelBits+ChannelCounterBits)
	}
	if 4+UserSourceBits+UserTagBits+UserSeqBits != 64 {
		t.Errorf("USER layout uses %d bits, want 64", 4+UserSourceBits+UserTagBits+UserSeqBits)
	}
	if MaxUserTag != 65535 || MaxUserRanks != 1<<24 {
		t.Errorf("MaxUserTag %d MaxUserRanks %d", MaxUserTag, MaxUserRanks)
	}
}

func TestMakeTagRoundTrip(t *testing.T) {
	for _, k := range counterKinds {
		for _, src := range []uint32{0, 1, 7, 1<<31 + 5, ^uint32(0)} {
			for _, c := range []uint32{0, 1, 12345, counterMask - 1, counterMask} {
				tag := MakeTag(k, src, c)
				gk, gs, gc := SplitTag(tag)
				if gk != k || gs != src || gc != c {
					t.Fatalf("SplitTag(MakeTag(%d, %#x, %#x)) = (%d, %#x, %#x)", k, src, c, gk, gs, gc)
				}
				if Kind(tag>>60) != k {
					t.Fatalf("kind %d not in the top four bits of %#x", k, tag)
				}
			}
		}
	}
}

func TestMakeTagCounterWraps(t *testing.T) {
	for _, k := range counterKinds {
		for _, src := range []uint32{0, 3, ^uint32(0)} {
			// 2^28 wraps to 0 without touching the source or kind fields.
			if a, b := MakeTag(k, src, 1<<CounterBits), MakeTag(k, src, 0); a != b {
				t.Fatalf("kind %d src %#x: counter 2^28 gives %#x, counter 0 gives %#x", k, src, a, b)
			}
			gk, gs, gc := SplitTag(MakeTag(k, src, 1<<CounterBits))
			if gk != k || gs != src || gc != 0 {
				t.Fatalf("counter 2^28: split (%d, %#x, %d)", gk, gs, gc)
			}
			// Incrementing past the top wraps; counter bits above 28 never leak.
			last := uint32(1<<CounterBits - 1)
			_, _, gc = SplitTag(MakeTag(k, src, last+1))
			if gc != 0 {
				t.Fatalf("counter 2^28-1 + 1 splits to %d, want 0", gc)
			}
			gk, gs, gc = SplitTag(MakeTag(k, src, ^uint32(0)))
			if gk != k || gs != src || gc != counterMask {
				t.Fatalf("counter 0xffffffff: split (%d, %#x, %#x), want (%d, %#x, %#x)", gk, gs, gc, k, src, counterMask)
			}
			if a, b := MakeTag(k, src, 5+3<<CounterBits), MakeTag(k, src, 5); a != b {
				t.Fatalf("counter 5+3*2^28 gives %#x, want %#x", a, b)
			}
		}
	}
}

func TestChannelTag(t *testing.T) {
	for _, ch := range []uint32{0, 1, 99, 1<<ChannelBits - 1} {
		for _, c := range []uint32{0, 1, 1 << 31, ^uint32(0)} {
			tag, err := MakeChannelTag(ch, c)
			if err != nil {
				t.Fatalf("MakeChannelTag(%d, %d): %v", ch, c, err)
			}
			if Kind(tag>>60) != KindChannel {
				t.Fatalf("channel tag %#x has kind %d", tag, tag>>60)
			}
			gch, gc := SplitChannelTag(tag)
			if gch != ch || gc != c {
				t.Fatalf("SplitChannelTag(MakeChannelTag(%d, %d)) = (%d, %d)", ch, c, gch, gc)
			}
		}
	}
	for _, ch := range []uint32{1 << ChannelBits, 1<<ChannelBits + 1, ^uint32(0)} {
		tag, err := MakeChannelTag(ch, 1)
		if err == nil {
			t.Fatalf("MakeChannelTag(%d) = %#x, want an error: id does not fit 28 bits", ch, tag)
		}
	}
	// The 32-bit per-channel-end counter wraps at 2^32 without touching the id.
	c := ^uint32(0)
	c++
	a, _ := MakeChannelTag(77, c)
	b, _ := MakeChannelTag(77, 0)
	if a != b {
		t.Fatalf("channel counter wrap: %#x != %#x", a, b)
	}
	if ch, _ := SplitChannelTag(a); ch != 77 {
		t.Fatalf("channel id after wrap: %d", ch)
	}
}

func TestUserTag(t *testing.T) {
	for _, src := range []uint32{0, 1, MaxUserRanks - 1} {
		for _, tg := range []uint16{0, 1, 1000, MaxUserTag} {
			for _, s := range []uint32{0, 1, userSeqMask - 1, userSeqMask} {
				tag := MakeUserTag(src, tg, s)
				if Kind(tag>>60) != KindUser {
					t.Fatalf("user tag %#x has kind %d", tag, tag>>60)
				}
				gs, gt, gq := SplitUserTag(tag)
				if gs != src || gt != tg || gq != s {
					t.Fatalf("SplitUserTag(MakeUserTag(%d, %d, %d)) = (%d, %d, %d)", src, tg, s, gs, gt, gq)
				}
			}
		}
	}
}

func TestUserSeqWraps(t *testing.T) {
	for _, src := range []uint32{0, 5, MaxUserRanks - 1} {
		for _, tg := range []uint16{0, 42, MaxUserTag} {
			if a, b := MakeUserTag(src, tg, 1<<UserSeqBits), MakeUserTag(src, tg, 0); a != b {
				t.Fatalf("seq 2^20 gives %#x, seq 0 gives %#x", a, b)
			}
			gs, gt, gq := SplitUserTag(MakeUserTag(src, tg, ^uint32(0)))
			if gs != src || gt != tg || gq != userSeqMask {
				t.Fatalf("seq 0xffffffff leaks: (%d, %d, %#x)", gs, gt, gq)
			}
		}
	}
	// The receive counter wraps the same way as the send side.
	c := &recvCounter{next: userSeqMask, mask: userSeqMask}
	if s := c.take(); s != userSeqMask {
		t.Fatalf("take = %d, want %d", s, userSeqMask)
	}
	if s := c.take(); s != 0 {
		t.Fatalf("take after 2^20-1 = %d, want 0", s)
	}
	// Freed numbers are reused first, in order.
	c.freed = []uint32{7, 9}
	if c.peek() != 7 || c.take() != 7 || c.take() != 9 || c.take() != 1 {
		t.Fatal("freed sequence numbers not reused first")
	}
}

// tagFields is a decoded tag in a kind-independent form, for collision checks.
type tagFields struct {
	kind    Kind
	a, b, c uint64
}

func drawTag(t *rapid.T) (uint64, tagFields) {
	switch rapid.IntRange(0, 2).Draw(t, "layout") {
	case 0:
		k := rapid.SampledFrom(counterKinds).Draw(t, "kind")
		src := rapid.Uint32().Draw(t, "source")
		c := rapid.Uint32Range(0, counterMask).Draw(t, "counter")
		return MakeTag(k, src, c), tagFields{kind: k, a: uint64(src), c: uint64(c)}
	case 1:
		ch := rapid.Uint32Range(0, 1<<ChannelBits-1).Draw(t, "channel")
		c := rapid.Uint32().Draw(t, "counter")
		tag, err := MakeChannelTag(ch, c)
		if err != nil {
			t.Fatalf("MakeChannelTag(%d, %d): %v", ch, c, err)
		}
		return tag, tagFields{kind: KindChannel, a: uint64(ch), c: uint64(c)}
	default:
		src := rapid.Uint32Range(0, MaxUserRanks-1).Draw(t, "source")
		tg := rapid.Uint16().Draw(t, "tag")
		s := rapid.Uint32Range(0, userSeqMask).Draw(t, "seq")
		return MakeUserTag(src, tg, s), tagFields{kind: KindUser, a: uint64(src), b: uint64(tg), c: uint64(s)}
	}
}

func decode(tag uint64) tagFields {
	switch k := Kind(tag >> 60); k {
	case KindChannel:
		ch, c := SplitChannelTag(tag)
		return tagFields{kind: k, a: uint64(ch), c: uint64(c)}
	case KindUser:
		s, tg, q := SplitUserTag(tag)
		return tagFields{kind: k, a: uint64(s), b: uint64(tg), c: uint64(q)}
	default:
		k, s, c := SplitTag(tag)
		return tagFields{kind: k, a: uint64(s), c: uint64(c)}
	}
}

// TestTagRoundTripProperty: every encoding decodes back to its fields, and two
// different field sets (of any kinds) never encode to the same tag.
func TestTagRoundTripProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		t1, f1 := drawTag(t)
		if got := decode(t1); got != f1 {
			t.Fatalf("tag %#x decodes to %+v, want %+v", t1, got, f1)
		}
		t2, f2 := drawTag(t)
		if got := decode(t2); got != f2 {
			t.Fatalf("tag %#x decodes to %+v, want %+v", t2, got, f2)
		}
		if (t1 == t2) != (f1 == f2) {
			t.Fatalf("collision: %+v -> %#x, %+v -> %#x", f1, t1, f2, t2)
		}
	})
}

// TestTagNoCollisionAcrossKinds: the same numeric fields under different
// kinds, sources or tags give different tags.
func TestTagNoCollisionAcrossKinds(t *testing.T) {
	seen := map[uint64]string{}
	add := func(tag uint64, what string) {
		t.Helper()
		if prev, ok := seen[tag]; ok {
			t.Fatalf("%s and %s both encode to %#x", prev, what, tag)
		}
		seen[tag] = what
	}
	for _, src := range []uint32{0, 1, 2} {
		for _, c := range []uint32{0, 1, 2} {
			for _, k := range counterKinds {
				add(MakeTag(k, src, c), fmt.Sprintf("MakeTag(%d, %d, %d)", k, src, c))
			}
			ct, _ := MakeChannelTag(src, c)
			add(ct, fmt.Sprintf("MakeChannelTag(%d, %d)", src, c))
			for _, tg := range []uint16{0, 1, 2} {
				add(MakeUserTag(src, tg, c), fmt.Sprintf("MakeUserTag(%d, %d, %d)", src, tg, c))
			}
		}
	}
}
