package transport

import (
	"strings"
	"testing"

	"github.com/troupe-hpc/troupe/gpu"
)

// The control messages of IPC channels decode what they encode and refuse
// what no sender makes.
func TestIPCDescCodec(t *testing.T) {
	d := ipcDesc{kind: ctlIPC, length: 300, base: 0x7f0000001000,
		h: gpu.IPCHandle{Offset: 4096, Length: 300, Size: 1 << 20}}
	for i := range d.h.Handle {
		d.h.Handle[i] = byte(i * 7)
	}
	got, err := decodeIPCDesc(d.encode())
	if err != nil || got != d {
		t.Fatalf("round trip: %+v, %v; want %+v", got, err, d)
	}
	hdr := ipcDesc{kind: ctlHeader, length: 12}
	if got, err := decodeIPCDesc(hdr.encode()); err != nil || got.kind != ctlHeader || got.length != 12 {
		t.Fatalf("header: %+v, %v", got, err)
	}
	bad := []struct {
		name string
		b    []byte
	}{
		{"short", d.encode()[:50]},
		{"magic", append([]byte("xxxxxxxx"), d.encode()[8:]...)},
		{"kind", (&ipcDesc{kind: 9}).encode()},
		{"beyond the allocation", (&ipcDesc{kind: ctlIPC, length: 10, h: gpu.IPCHandle{Offset: 100, Size: 105}}).encode()},
		{"no size", (&ipcDesc{kind: ctlIPC, length: 10}).encode()},
	}
	for _, c := range bad {
		if _, err := decodeIPCDesc(c.b); err == nil {
			t.Errorf("%s: decoded", c.name)
		}
	}
	a := encodeAck(ackSize, 77, strings.Repeat("x", 1000))
	if len(a) != ipcAckSize {
		t.Fatalf("ack of %d bytes, want at most %d", len(a), ipcAckSize)
	}
}

// Control and acknowledgement tags never equal a channel data tag, and
// differ from each other.
func TestIPCTags(t *testing.T) {
	data, err := MakeChannelTag(5, 9)
	if err != nil {
		t.Fatal(err)
	}
	ctl, ack := data|chanCtlBit, ipcAckTag(5, 9)
	if Kind(ctl>>kindShift) != KindChannelCtl || Kind(ack>>kindShift) != KindChannelAck {
		t.Fatalf("kinds %d and %d", ctl>>kindShift, ack>>kindShift)
	}
	if ctl == data || ack == data || ack == ctl {
		t.Fatal("tags collide")
	}
	if id, ctr := SplitChannelTag(ack); id != 5 || ctr != 9 {
		t.Fatalf("ack tag fields %d %d", id, ctr)
	}
}

// Ranks of one process never use IPC with each other (the driver refuses a
// process's own handles); TROUPE_GPU_IPC=off and Options.DisableGPUIPC say
// why the path is off; every rank knows it shares the host with the others.
func TestGPUIPCOffLocally(t *testing.T) {
	t.Setenv(EnvGPUIPC, "off")
	ts := localJob(t, 2, ProgressDirect)
	for _, tr := range ts {
		st := tr.GPUIPCStats()
		if st.Enabled || st.Off != EnvGPUIPC+"=off" || st.Peers != 0 {
			t.Fatalf("stats %+v", st)
		}
		if !tr.SameHost(0) || !tr.SameHost(1) || tr.SameHost(2) || tr.SameHost(-1) {
			t.Fatal("same-host knowledge wrong")
		}
	}
	if ok, why := gpuIPCWanted(Options{DisableGPUIPC: true}); ok || why != "Options.DisableGPUIPC" {
		t.Fatalf("DisableGPUIPC: %v %q", ok, why)
	}
	t.Setenv(EnvGPUIPC, "maybe")
	if ok, why := gpuIPCWanted(Options{}); ok || !strings.Contains(why, "not off, on or auto") {
		t.Fatalf("bad value: %v %q", ok, why)
	}
	t.Setenv(EnvGPUIPC, "on")
	t.Setenv(gpu.EnvBackend, gpu.BackendHost)
	if ok, why := gpuIPCWanted(Options{}); ok || why != "TROUPE_GPU=host" {
		t.Fatalf("host backend: %v %q", ok, why)
	}
	t.Setenv(gpu.EnvBackend, "")
	ok, why := gpuIPCWanted(Options{})
	if drv := gpu.CUDADriverPresent(); (drv == nil) != ok || (!ok && why != drv.Error()) {
		t.Fatalf("auto: %v %q, driver: %v", ok, why, drv)
	}
}
