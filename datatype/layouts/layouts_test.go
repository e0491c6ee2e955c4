package layouts

import (
	"testing"
	"time"

	dt "github.com/troupe-hpc/troupe/datatype"
)

func TestPackedSizes(t *testing.T) {
	for _, name := range Names {
		l, err := Build(name)
		if err != nil {
			t.Fatal(err)
		}
		n, err := l.Type.PackedSize(1)
		if err != nil || n != l.Packed {
			t.Errorf("%s: packed size %d, %v; want %d", name, n, err, l.Packed)
		}
		if l.Base+l.Type.TrueLB() < 0 || l.Base+l.Type.TrueUB() > l.Alloc {
			t.Errorf("%s: data [%d,%d)+%d outside allocation %d", name, l.Type.TrueLB(), l.Type.TrueUB(), l.Base, l.Alloc)
		}
	}
	if len(Names) != 13 {
		t.Fatalf("%d layouts, want 13", len(Names))
	}
}

func TestQuickMeasure(t *testing.T) {
	l, err := Build("vec_64B")
	if err != nil {
		t.Fatal(err)
	}
	r, err := Measure(l, time.Millisecond, 1, 1)
	if err != nil || r.PackGBps <= 0 || r.Workers != 0 {
		t.Fatal(r, err)
	}
}

// TestWorkersRule checks which benchmark layouts are page-bound: only
// nas_mg_x (8-byte elements 4112 B apart over 273 MB) is split between
// goroutines; the others are bound by caches or memory bandwidth, where a
// second goroutine measured slower.
func TestWorkersRule(t *testing.T) {
	for _, name := range Names {
		l, err := Build(name)
		if err != nil {
			t.Fatal(err)
		}
		w := l.Type.Workers(1, 8)
		if want := name == "nas_mg_x"; (w > 1) != want {
			t.Errorf("%s: Workers(1, 8) = %d, page-bound %v", name, w, want)
		}
	}
}

// TestPackMatchesSegments packs every layout and compares with a pack built
// from the segment iterator, and checks that the two WRF variants agree.
func TestPackMatchesSegments(t *testing.T) {
	packs := map[string][]byte{}
	for _, name := range Names {
		l, err := Build(name)
		if err != nil {
			t.Fatal(err)
		}
		src, packed := l.Buffers()
		if _, err := l.Type.Pack(packed, src, l.Base, 1); err != nil {
			t.Fatal(name, err)
		}
		seq, err := l.Type.Segments(1, 0, -1)
		if err != nil {
			t.Fatal(err)
		}
		var ref []byte
		for s := range seq {
			ref = append(ref, src[l.Base+s.Off:l.Base+s.Off+s.Len]...)
		}
		if string(ref) != string(packed) {
			t.Errorf("%s: Pack differs from the segments", name)
		}
		par := make([]byte, len(packed))
		if _, err := l.Type.PackParallel(dt.SliceRegion(par), dt.SliceRegion(src), l.Base, 1, 0, 4); err != nil || string(par) != string(packed) {
			t.Errorf("%s: PackParallel with 4 workers differs from Pack (%v)", name, err)
		}
		// Unpack into a zeroed buffer and compare the typemap bytes.
		back := make([]byte, l.Alloc)
		if _, err := l.Type.Unpack(back, packed, l.Base, 1); err != nil {
			t.Fatal(err)
		}
		for s := range seq {
			if string(back[l.Base+s.Off:l.Base+s.Off+s.Len]) != string(src[l.Base+s.Off:l.Base+s.Off+s.Len]) {
				t.Fatalf("%s: unpack differs at segment %+v", name, s)
			}
		}
		if name == "wrf_y_vec" || name == "wrf_y_sa" {
			packs[name] = packed
		}
	}
	if string(packs["wrf_y_vec"]) != string(packs["wrf_y_sa"]) {
		t.Error("wrf_y_vec and wrf_y_sa pack different bytes")
	}
}
