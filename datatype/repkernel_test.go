package datatype

import (
	"bytes"
	"testing"
)

func TestRepFaster(t *testing.T) {
	for _, c := range []struct {
		vendor        string
		family, model uint32
		erms, want    bool
	}{
		{"AuthenticAMD", 0x19, 0x01, true, false}, // Zen 3 EPYC Milan (measured slower)
		{"AuthenticAMD", 0x19, 0x21, true, false}, // Zen 3 Vermeer
		{"AuthenticAMD", 0x19, 0x11, true, true},  // Zen 4 EPYC Genoa (measured faster)
		{"AuthenticAMD", 0x19, 0x61, true, true},  // Zen 4 Raphael
		{"AuthenticAMD", 0x19, 0xa0, true, true},  // Zen 4c Bergamo
		{"AuthenticAMD", 0x17, 0x31, true, false}, // Zen 2
		{"AuthenticAMD", 0x1a, 0x02, true, true},  // Zen 5
		{"GenuineIntel", 0x06, 0x8f, true, true},  // Sapphire Rapids (unmeasured)
		{"GenuineIntel", 0x06, 0xcf, true, false}, // Emerald Rapids (measured slower)
		{"HygonGenuine", 0x18, 0x00, true, false}, // Hygon Dhyana: a Zen core
		{"CentaurHauls", 0x06, 0x0f, true, true},  // other vendors: unmeasured
		{"GenuineIntel", 0x06, 0x8f, false, false},
		{"AuthenticAMD", 0x19, 0x11, false, false},
	} {
		if got := repFaster(c.vendor, c.family, c.model, c.erms); got != c.want {
			t.Errorf("repFaster(%s, %#x, %#x, erms %v) = %v, want %v", c.vendor, c.family, c.model, c.erms, got, c.want)
		}
	}
}

// TestRepKernelSetting: whatever the setting, packs and unpacks of blocks in
// the REP MOVSB kernel's range move the same bytes; the setting sticks
// only where the CPU has the kernel.
func TestRepKernelSetting(t *testing.T) {
	was := RepKernel()
	defer SetRepKernel(was)
	for _, bl := range []int64{repKernelMin - 1, repKernelMin, 3072, 4096 + 8, 16<<10 + 24, 64 << 10, repKernelMax, repKernelMax + 1} {
		const n = 5
		typ, err := Vector(n, bl, 2*bl+8, Byte)
		if err != nil {
			t.Fatal(err)
		}
		src := make([]byte, typ.TrueUB())
		for i := range src {
			src[i] = byte(i*131 + 7)
		}
		var packed [2][]byte
		var unpacked [2][]byte
		for i, on := range []bool{false, true} {
			if got := SetRepKernel(on); got != (on && hasRepKernel) || RepKernel() != got {
				t.Fatalf("SetRepKernel(%v) = %v, RepKernel %v (CPU has it: %v)", on, got, RepKernel(), hasRepKernel)
			}
			packed[i] = make([]byte, n*bl)
			if _, err := typ.Pack(packed[i], src, 0, 1); err != nil {
				t.Fatal(err)
			}
			unpacked[i] = make([]byte, len(src))
			if _, err := typ.Unpack(unpacked[i], packed[i], 0, 1); err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(packed[0], packed[1]) || !bytes.Equal(unpacked[0], unpacked[1]) {
			t.Fatalf("blocks of %d bytes: the REP MOVSB kernel moved other bytes", bl)
		}
		for b := int64(0); b < n; b++ {
			if !bytes.Equal(packed[1][b*bl:(b+1)*bl], src[b*(2*bl+8):b*(2*bl+8)+bl]) {
				t.Fatalf("blocks of %d bytes: block %d packed wrong", bl, b)
			}
		}
	}
}
