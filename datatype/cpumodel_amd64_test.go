//go:build amd64 && !purego

package datatype

import "testing"

// TestCPUModel: the CPU names a vendor and a family, and the default
// setting is the rule's verdict on them.
func TestCPUModel(t *testing.T) {
	vendor, family, model := cpuModel()
	if len(vendor) != 12 || family == 0 {
		t.Fatalf("cpuModel: %q family %#x model %#x", vendor, family, model)
	}
	t.Logf("%s family %#x model %#x: REP MOVSB kernel by default %v (ERMS %v)", vendor, family, model, repFaster(vendor, family, model, hasRepKernel), hasRepKernel)
}
