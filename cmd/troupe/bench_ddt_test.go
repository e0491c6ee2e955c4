package main

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype/layouts"
)

// Without --layout every layout runs; --layout "" (an empty list) and an
// empty or unknown name among others are refused (--layout "" ran all 13).
func TestDDTLayouts(t *testing.T) {
	if got, err := ddtLayouts(nil, false); err != nil || !slices.Equal(got, layouts.Names) {
		t.Errorf("no --layout: %v, %v; want all of %v", got, err, layouts.Names)
	}
	if got, err := ddtLayouts([]string{"milc_zd", "nas_mg_x"}, true); err != nil || !slices.Equal(got, []string{"milc_zd", "nas_mg_x"}) {
		t.Errorf("--layout milc_zd,nas_mg_x: %v, %v", got, err)
	}
	for _, c := range []struct {
		names []string
		want  string
	}{
		{[]string{}, "empty layout name"},
		{[]string{"milc_zd", ""}, "empty layout name"},
		{[]string{"bogus"}, `unknown layout "bogus"`},
	} {
		if got, err := ddtLayouts(c.names, true); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("--layout %q: %v, %v; want an error naming %q", c.names, got, err, c.want)
		}
	}
}

// measureDDTChild measures a layout in a new process of this executable (the
// test binary acting as troupe) and returns its figures; a child that fails
// is an error naming the layout and what the child said.
func TestMeasureDDTChild(t *testing.T) {
	t.Setenv(envTestMain, "1")
	r, err := measureDDTChild("vec_64B", 2*time.Millisecond, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	if r.Layout != "vec_64B" || r.Bytes != 4096 || r.PackGBps <= 0 || r.UnpackGBps <= 0 || r.CopyGBps <= 0 {
		t.Errorf("child measured %+v, want vec_64B, 4096 bytes and three positive rates", r)
	}
	if _, err := measureDDTChild("bogus", time.Millisecond, 1, 1); err == nil ||
		!strings.Contains(err.Error(), "bogus") || !strings.Contains(err.Error(), "unknown layout") {
		t.Errorf("child on an unknown layout: %v, want an error naming it", err)
	}
}
