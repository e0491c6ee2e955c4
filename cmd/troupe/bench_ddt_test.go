package main

import (
	"slices"
	"strings"
	"testing"

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
