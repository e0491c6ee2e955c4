package datatype

import (
	"errors"
	"slices"
	"testing"

	"pgregory.net/rapid"
)

func TestSchemeNames(t *testing.T) {
	for _, s := range []Scheme{SchemeAuto, SchemePack, SchemeSGL, SchemeZCopy} {
		got, err := ParseScheme(s.String())
		if err != nil || got != s {
			t.Fatalf("ParseScheme(%q) = %v, %v", s.String(), got, err)
		}
	}
	if _, err := ParseScheme("umr"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("ParseScheme(umr) error %v, want ErrInvalidArgument", err)
	}
}

func TestSelectLocal(t *testing.T) {
	th := DefaultThresholds()
	th.ZCopyAvgBlock = 2048
	th.WindowMinBlock = 512
	big := Stats{Segments: 64, Bytes: 64 * 4096, MinBlock: 4096, MaxBlock: 4096, AvgBlock: 4096}
	many := Stats{Segments: 1024, Bytes: 1024 * 4096, MinBlock: 4096, MaxBlock: 4096, AvgBlock: 4096}
	tooMany := Stats{Segments: th.SGLMaxSegments + 1, Bytes: (th.SGLMaxSegments + 1) * 4096, MinBlock: 4096, MaxBlock: 4096, AvgBlock: 4096}
	small := Stats{Segments: 64, Bytes: 64 * 64, MinBlock: 64, MaxBlock: 64, AvgBlock: 64}
	mixed := Stats{Segments: 64, Bytes: 64 * 4096, MinBlock: 100, MaxBlock: 8000, AvgBlock: 4096}
	cases := []struct {
		name              string
		st                Stats
		known, registered bool
		want              Scheme
		wantReg           bool
	}{
		{"first use, large blocks", big, false, false, SchemePack, true},
		{"first use, small blocks", small, false, false, SchemePack, false},
		{"known, not yet registered", big, true, false, SchemePack, true},
		{"registered, fits windows", big, true, true, SchemeZCopy, false},
		{"registered, too many segments for windows", many, true, true, SchemeSGL, false},
		{"registered, a block under WindowMinBlock", mixed, true, true, SchemeSGL, false},
		{"registered, too many segments for SGL", tooMany, true, true, SchemePack, false},
		{"registered, small blocks", small, true, true, SchemePack, false},
		{"empty", Stats{}, true, true, SchemePack, false},
	}
	for _, c := range cases {
		s, reg := th.SelectLocal(c.st, c.known, c.registered)
		if s != c.want || reg != c.wantReg {
			t.Errorf("%s: SelectLocal = %v, %v; want %v, %v", c.name, s, reg, c.want, c.wantReg)
		}
	}
}

func TestAgree(t *testing.T) {
	all := []Scheme{SchemePack, SchemeSGL, SchemeZCopy}
	for _, p := range all {
		for _, l := range all {
			got := Agree(p, l)
			var want Scheme
			switch {
			case p == SchemePack || l == SchemePack:
				want = SchemePack
			case p == SchemeZCopy && l == SchemeZCopy:
				want = SchemeZCopy
			default:
				want = SchemeSGL
			}
			if got != want {
				t.Errorf("Agree(%v, %v) = %v, want %v", p, l, got, want)
			}
		}
	}
}

func TestAgreeChunk(t *testing.T) {
	for _, c := range []struct {
		m          int
		s, r, want int64
	}{
		{16, 4096, 512, 16 * 512},
		{16, 64, 4096, 16 * 64},
		{8, 0, 100, 800},
		{8, 100, 0, 800},
		{8, 0, 0, 8},
	} {
		got, err := AgreeChunk(c.m, c.s, c.r)
		if err != nil || got != c.want {
			t.Errorf("AgreeChunk(%d, %d, %d) = %d, %v; want %d", c.m, c.s, c.r, got, err, c.want)
		}
	}
	if _, err := AgreeChunk(0, 1, 1); err == nil {
		t.Error("AgreeChunk with maxIOVs 0: no error")
	}
	if _, err := AgreeChunk(2, 1<<62, 1<<62); !errors.Is(err, ErrOverflow) {
		t.Errorf("AgreeChunk overflow: %v", err)
	}
}

// genIOVs draws a layout: blocks of random lengths at increasing addresses
// with random gaps.
func genIOVs(t *rapid.T, label string) []IOV {
	n := rapid.IntRange(0, 40).Draw(t, label+"n")
	iovs := make([]IOV, n)
	addr := uintptr(rapid.IntRange(0, 100).Draw(t, label+"base"))
	for i := range iovs {
		l := int64(rapid.IntRange(1, 300).Draw(t, label+"len"))
		iovs[i] = IOV{Addr: addr, Len: l}
		addr += uintptr(l) + uintptr(rapid.IntRange(1, 200).Draw(t, label+"gap"))
	}
	if rapid.Bool().Draw(t, label+"descending") {
		// Negative strides and structs with fields out of order give layouts
		// whose blocks do not ascend in memory.
		slices.Reverse(iovs)
	}
	return iovs
}

func totalLen(iovs []IOV) int64 {
	var n int64
	for _, v := range iovs {
		n += v.Len
	}
	return n
}

// expand lists the address of every packed byte of a piece list.
func expand(iovs []IOV) []uintptr {
	var out []uintptr
	for _, v := range iovs {
		for k := int64(0); k < v.Len; k++ {
			out = append(out, v.Addr+uintptr(k))
		}
	}
	return out
}

// TestPropertyWindows: windows cut a layout into consecutive packed ranges of
// exactly chunk bytes (the last shorter), their pieces are exactly the
// layout's bytes in order (no gap byte), each window's span bounds its
// pieces, and with chunk = M x min block a window touches at most M+1 blocks.
func TestPropertyWindows(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		iovs := genIOVs(t, "a")
		st := ComputeStats(toSegs(iovs))
		m := rapid.IntRange(1, 8).Draw(t, "maxIOVs")
		chunk, err := AgreeChunk(m, st.MinBlock, 0)
		if err != nil {
			t.Fatal(err)
		}
		if rapid.Bool().Draw(t, "arbitraryChunk") {
			chunk = int64(rapid.IntRange(1, 700).Draw(t, "chunk"))
		}
		ws, err := Windows(iovs, chunk)
		if err != nil {
			t.Fatal(err)
		}
		total := totalLen(iovs)
		if want := Chunks(total, chunk); int64(len(ws)) != want {
			t.Fatalf("%d windows, want %d", len(ws), want)
		}
		var all []IOV
		var off int64
		for k, w := range ws {
			if w.Off != off {
				t.Fatalf("window %d at packed offset %d, want %d", k, w.Off, off)
			}
			if k < len(ws)-1 && w.Len != chunk {
				t.Fatalf("window %d holds %d bytes, want %d", k, w.Len, chunk)
			}
			ps := w.Pieces(iovs, nil)
			if totalLen(ps) != w.Len {
				t.Fatalf("window %d pieces hold %d bytes, want %d", k, totalLen(ps), w.Len)
			}
			lo, hi := ^uintptr(0), uintptr(0)
			for _, p := range ps {
				lo, hi = min(lo, p.Addr), max(hi, p.Addr+uintptr(p.Len))
			}
			if len(ps) > 0 && (lo != w.Addr || hi != w.End) {
				t.Fatalf("window %d span [%d,%d) is not the bounds [%d,%d) of its pieces %v", k, w.Addr, w.End, lo, hi, ps)
			}
			if chunk == int64(m)*max(st.MinBlock, 1) && len(ps) > m+1 {
				t.Fatalf("window %d touches %d blocks, more than %d", k, len(ps), m+1)
			}
			all = append(all, ps...)
			off += w.Len
		}
		got, want := expand(all), expand(iovs)
		if len(got) != len(want) {
			t.Fatalf("windows hold %d bytes, layout %d", len(got), len(want))
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("packed byte %d at address %d, want %d", i, got[i], want[i])
			}
		}
	})
}

// TestPropertyMoves: the moves between two layouts of equal size pair packed
// byte i of the sender with packed byte i of the receiver, window by window.
func TestPropertyMoves(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		src := genIOVs(t, "s")
		total := totalLen(src)
		// A receiver layout of the same size: random cuts of total bytes.
		var rcv []IOV
		addr := uintptr(1 << 20)
		for left := total; left > 0; {
			l := min(left, int64(rapid.IntRange(1, 250).Draw(t, "rlen")))
			rcv = append(rcv, IOV{Addr: addr, Len: l})
			addr += uintptr(l) + uintptr(rapid.IntRange(1, 50).Draw(t, "rgap"))
			left -= l
		}
		chunk := int64(rapid.IntRange(1, 500).Draw(t, "chunk"))
		sw, err := Windows(src, chunk)
		if err != nil {
			t.Fatal(err)
		}
		rw, err := Windows(rcv, chunk)
		if err != nil {
			t.Fatal(err)
		}
		if len(sw) != len(rw) {
			t.Fatalf("%d sender windows, %d receiver windows", len(sw), len(rw))
		}
		var moves []Move
		for k := range sw {
			if moves, err = Moves(sw[k].Pieces(src, nil), rw[k].Pieces(rcv, nil), moves); err != nil {
				t.Fatal(err)
			}
		}
		se, re := expand(src), expand(rcv)
		i := 0
		for _, mv := range moves {
			for k := int64(0); k < mv.Len; k++ {
				if mv.Src+uintptr(k) != se[i] || mv.Dst+uintptr(k) != re[i] {
					t.Fatalf("packed byte %d moves %d -> %d, want %d -> %d", i, mv.Src+uintptr(k), mv.Dst+uintptr(k), se[i], re[i])
				}
				i++
			}
		}
		if int64(i) != total {
			t.Fatalf("moves carry %d bytes, want %d", i, total)
		}
	})
}

func TestMovesSizeMismatch(t *testing.T) {
	if _, err := Moves([]IOV{{0, 10}}, []IOV{{100, 9}}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("sender larger: %v", err)
	}
	if _, err := Moves([]IOV{{0, 9}}, []IOV{{100, 10}}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("receiver larger: %v", err)
	}
}

// TestMovesNegativeLength: a piece of negative length is refused; it drove
// the receiver's cursor back and gave moves outside its pieces.
func TestMovesNegativeLength(t *testing.T) {
	if m, err := Moves([]IOV{{100, -5}, {200, 10}}, []IOV{{300, 5}}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative sender piece: moves %v, error %v", m, err)
	}
	if m, err := Moves([]IOV{{100, 5}}, []IOV{{300, -5}, {400, 10}}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative receiver piece: moves %v, error %v", m, err)
	}
}

func TestDataBounds(t *testing.T) {
	v, err := Vector(3, 2, 5, Float64) // blocks at 0, 40, 80 of 16 bytes
	if err != nil {
		t.Fatal(err)
	}
	lo, hi, err := v.DataBounds(2) // extent 96: second element ends at 96+96
	if err != nil || lo != 0 || hi != 96+96 {
		t.Fatalf("DataBounds(2) = %d, %d, %v; want 0, 192", lo, hi, err)
	}
	if lo, hi, err := v.DataBounds(0); err != nil || lo != 0 || hi != 0 {
		t.Fatalf("DataBounds(0) = %d, %d, %v", lo, hi, err)
	}
}

func toSegs(iovs []IOV) []Segment {
	s := make([]Segment, len(iovs))
	for i, v := range iovs {
		s[i] = Segment{Off: int64(v.Addr), Len: v.Len}
	}
	return s
}

// TestChunksNearLimit: the chunk count of a payload near 2^63 bytes is exact
// (rounding up as total+chunk-1 overflowed to a negative count).
func TestChunksNearLimit(t *testing.T) {
	for _, c := range []struct{ total, chunk, want int64 }{
		{1<<63 - 4, 8, 1 << 60},
		{1<<63 - 1, 1 << 62, 2},
		{1<<63 - 1, 1<<63 - 1, 1},
		{10, 3, 4},
		{9, 3, 3},
		{0, 3, 0},
	} {
		if got := Chunks(c.total, c.chunk); got != c.want {
			t.Errorf("Chunks(%d, %d) = %d, want %d", c.total, c.chunk, got, c.want)
		}
	}
}
