package jacobi

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/internal/cudatest"
)

// TestPTXUpToDate: the embedded PTX is what clang makes of kernels.cu now
// (skipped without clang; `make ptx` regenerates it).
func TestPTXUpToDate(t *testing.T) { cudatest.RequirePTX(t, "kernels.cu", "kernels.ptx") }

// TestPlane: the plane geometry the device kernel uses addresses exactly
// the points PackFaceTo reads and UnpackFace writes, in the same order.
func TestPlane(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 50 {
		b := NewBlock(Box{NX: 1 + r.IntN(7), NY: 1 + r.IntN(7), NZ: 1 + r.IntN(7)})
		u := make([]float64, b.Len())
		for i := range u {
			u[i] = float64(i)
		}
		for d := range NumDirs {
			want := b.PackFace(u, d)
			p := b.plane(d, true)
			got := make([]float64, 0, len(want))
			for p2 := range p.n2 {
				for p1 := range p.n1 {
					got = append(got, u[p.base+p1*p.s1+p2*p.s2])
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("block %+v face %d: plane packs %v, PackFace %v", b.Box, d, got, want)
			}
			// Unpacking: the ghost plane gets the face through both.
			face := make([]float64, b.FaceLen(d))
			for i := range face {
				face[i] = -float64(i + 1)
			}
			wantU := slices.Clone(u)
			if err := b.UnpackFace(wantU, d, face); err != nil {
				t.Fatal(err)
			}
			gotU := slices.Clone(u)
			g := b.plane(d, false)
			for p2 := range g.n2 {
				for p1 := range g.n1 {
					gotU[g.base+p1*g.s1+p2*g.s2] = face[p1+g.n1*p2]
				}
			}
			if !slices.Equal(gotU, wantU) {
				t.Fatalf("block %+v face %d: plane unpacks differently from UnpackFace", b.Box, d)
			}
		}
	}
}

// checkStencil runs dev's stencil kernels once each on a block with an
// uneven shape and a random field and compares them with Block's Go code:
// packed faces, unpacked ghost planes, the swept field and the residual,
// bit for bit.
func checkStencil(t *testing.T, dev *gpu.Device) {
	sten, err := newStencil(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer sten.release()
	st, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Destroy()
	geo := NewBlock(Box{NX: 37, NY: 5, NZ: 3})
	r := rand.New(rand.NewPCG(3, 4))
	u := make([]float64, geo.Len())
	for i := range u {
		u[i] = r.Float64()
	}
	alloc := func(n int) gpu.Buffer {
		b, err := dev.Alloc(n * 8)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { gpu.Free(b) })
		return b
	}
	load := func(b gpu.Buffer) []float64 {
		out := make([]byte, b.Len())
		if err := gpu.CopyToHost(out, b); err != nil {
			t.Fatal(err)
		}
		v, err := float64View(out)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	du, dv, res := alloc(geo.Len()), alloc(geo.Len()), alloc(1)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(gpu.CopyFromHost(du, float64Bytes(u)))
	must(gpu.CopyFromHost(dv, float64Bytes(u)))

	// Pack every face.
	dirs := []int{XLow, XHigh, YLow, YHigh, ZLow, ZHigh}
	faces := make([]gpu.Buffer, NumDirs)
	for d := range faces {
		faces[d] = alloc(geo.FaceLen(d))
	}
	must(sten.faces(st, geo, true, du, dirs, faces))
	must(st.Synchronize())
	for d := range NumDirs {
		if got, want := load(faces[d]), geo.PackFace(u, d); !slices.Equal(got, want) {
			t.Fatalf("face %d packed on %v differs from PackFace", d, dev)
		}
	}
	// Unpack other values into every ghost plane.
	wantU := slices.Clone(u)
	for d := range NumDirs {
		f := make([]float64, geo.FaceLen(d))
		for i := range f {
			f[i] = -r.Float64()
		}
		must(gpu.CopyFromHost(faces[d], float64Bytes(f)))
		must(geo.UnpackFace(wantU, d, f))
	}
	must(sten.faces(st, geo, false, du, dirs, faces))
	must(st.Synchronize())
	if !slices.Equal(load(du), wantU) {
		t.Fatalf("ghost planes unpacked on %v differ from UnpackFace", dev)
	}
	// Sweep.
	wantV := slices.Clone(u)
	wantR := geo.Sweep(wantU, wantV)
	must(sten.sweep(st, geo, du, dv, res))
	must(st.Synchronize())
	if !slices.Equal(load(dv), wantV) {
		t.Fatalf("sweep on %v differs from Block.Sweep", dev)
	}
	if got := load(res)[0]; got != wantR {
		t.Fatalf("residual on %v: %v, want %v", dev, got, wantR)
	}
}

// TestStencilHost: the host backend's Go kernels (the reference for the
// cuda test, which runs checkStencil in TestRunGPUCUDA).
func TestStencilHost(t *testing.T) { checkStencil(t, hostDevice(t)) }
