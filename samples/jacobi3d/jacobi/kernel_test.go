package jacobi

import (
	"fmt"
	"math"
	"testing"
)

// naive is a textbook Jacobi on the whole grid with the boundary as a
// function, independent of the padded layout: the reference for the kernel.
func naive(nx, ny, nz, sweeps int) ([]float64, float64) {
	at := func(u []float64, i, j, k int) float64 {
		switch {
		case i == -1:
			return HotValue
		case i == nx || j == -1 || j == ny || k == -1 || k == nz:
			return 0
		}
		return u[i+nx*(j+ny*k)]
	}
	u := make([]float64, nx*ny*nz)
	v := make([]float64, nx*ny*nz)
	r := 0.0
	for s := 0; s < sweeps; s++ {
		r = 0
		for k := 0; k < nz; k++ {
			for j := 0; j < ny; j++ {
				for i := 0; i < nx; i++ {
					s := at(u, i, j, k)
					s += at(u, i-1, j, k)
					s += at(u, i+1, j, k)
					s += at(u, i, j-1, k)
					s += at(u, i, j+1, k)
					s += at(u, i, j, k-1)
					s += at(u, i, j, k+1)
					nv := float64(s * C7)
					v[i+nx*(j+ny*k)] = nv
					r = max(r, math.Abs(nv-u[i+nx*(j+ny*k)]))
				}
			}
		}
		u, v = v, u
	}
	return u, r
}

func sameBits(t *testing.T, what string, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d points, want %d", what, len(got), len(want))
	}
	for p := range got {
		if math.Float64bits(got[p]) != math.Float64bits(want[p]) {
			t.Fatalf("%s: point %d is %v, want %v", what, p, got[p], want[p])
		}
	}
}

func TestC7(t *testing.T) {
	if C7 != 0.14285714285714285 || math.Float64bits(C7) != 0x3FC2492492492492 {
		t.Fatalf("C7 = %v (%#x)", C7, math.Float64bits(C7))
	}
}

func TestSerialMatchesNaive(t *testing.T) {
	for _, g := range [][3]int{{1, 1, 1}, {7, 5, 6}, {12, 3, 9}} {
		for _, sweeps := range []int{1, 2, 13} {
			got, gr := Serial(g[0], g[1], g[2], sweeps)
			want, wr := naive(g[0], g[1], g[2], sweeps)
			sameBits(t, "field", got, want)
			if gr != wr {
				t.Fatalf("%v after %d sweeps: residual %v, want %v", g, sweeps, gr, wr)
			}
		}
	}
}

// TestReferenceValues checks the values published in docs/jacobi3d.md.
func TestReferenceValues(t *testing.T) {
	for _, tc := range []struct {
		n, sweeps int
		residual  float64
		hash      uint64
	}{
		{24, 110, 0.001959700454547797, 4680158110166553},
		{24, 30, 0.0080447952686761859, 3139269223917833},
		{96, 30, 0.008045845627274506, 2224612403352140},
	} {
		if tc.n > 24 && (testing.Short() || raceEnabled) {
			continue
		}
		field, r := Serial(tc.n, tc.n, tc.n, tc.sweeps)
		if r != tc.residual {
			t.Errorf("grid %d, %d sweeps: residual %v, want %v", tc.n, tc.sweeps, r, tc.residual)
		}
		if h := HashField(field); h != tc.hash {
			t.Errorf("grid %d, %d sweeps: field_hash %d, want %d", tc.n, tc.sweeps, h, tc.hash)
		}
	}
}

func TestSplit(t *testing.T) {
	for n := 1; n < 30; n++ {
		for parts := 1; parts <= n; parts++ {
			next := 0
			for p := 0; p < parts; p++ {
				start, size := Split(n, parts, p)
				if start != next || size < n/parts || size > n/parts+1 {
					t.Fatalf("Split(%d, %d, %d) = %d, %d", n, parts, p, start, size)
				}
				next = start + size
			}
			if next != n {
				t.Fatalf("Split(%d, %d) covers %d", n, parts, next)
			}
		}
	}
}

// TestBlocksMatchSerial runs the block decomposition without actors: blocks
// exchange faces in memory after each sweep. It checks PackFace, UnpackFace,
// the boundary ghosts and HashPartial against the serial reference.
func TestBlocksMatchSerial(t *testing.T) {
	const nx, ny, nz, sweeps = 10, 9, 11, 17
	shape := [3]int{3, 2, 4}
	type blk struct {
		geo  Block
		u, v []float64
	}
	var bs []*blk
	at := func(x, y, z int) *blk {
		if x < 0 || y < 0 || z < 0 || x >= shape[0] || y >= shape[1] || z >= shape[2] {
			return nil
		}
		return bs[(x*shape[1]+y)*shape[2]+z]
	}
	for x := 0; x < shape[0]; x++ {
		for y := 0; y < shape[1]; y++ {
			for z := 0; z < shape[2]; z++ {
				g := NewBlock(BlockBox(nx, ny, nz, shape, x, y, z))
				bs = append(bs, &blk{geo: g, u: make([]float64, g.Len()), v: make([]float64, g.Len())})
			}
		}
	}
	nbr := func(x, y, z, d int) *blk {
		off := [NumDirs][3]int{{-1, 0, 0}, {1, 0, 0}, {0, -1, 0}, {0, 1, 0}, {0, 0, -1}, {0, 0, 1}}[d]
		return at(x+off[0], y+off[1], z+off[2])
	}
	forEach := func(f func(x, y, z int, b *blk)) {
		for x := 0; x < shape[0]; x++ {
			for y := 0; y < shape[1]; y++ {
				for z := 0; z < shape[2]; z++ {
					f(x, y, z, at(x, y, z))
				}
			}
		}
	}
	forEach(func(x, y, z int, b *blk) {
		for d := 0; d < NumDirs; d++ {
			if nbr(x, y, z, d) == nil {
				b.geo.FillGhost(b.u, d, BoundaryValue(d))
				b.geo.FillGhost(b.v, d, BoundaryValue(d))
			}
		}
	})
	var res float64
	for s := 0; s < sweeps; s++ {
		forEach(func(x, y, z int, b *blk) {
			for d := 0; d < NumDirs; d++ {
				if n := nbr(x, y, z, d); n != nil {
					if err := b.geo.UnpackFace(b.u, d, n.geo.PackFace(n.u, d^1)); err != nil {
						t.Fatal(err)
					}
				}
			}
		})
		res = 0
		forEach(func(x, y, z int, b *blk) { res = max(res, b.geo.Sweep(b.u, b.v)) })
		forEach(func(x, y, z int, b *blk) { b.u, b.v = b.v, b.u })
	}
	want, wr := Serial(nx, ny, nz, sweeps)
	got := make([]float64, nx*ny*nz)
	var h uint64
	forEach(func(x, y, z int, b *blk) {
		h += b.geo.HashPartial(b.u, nx, ny)
		in := b.geo.Interior(b.u)
		p := 0
		for k := 0; k < b.geo.NZ; k++ {
			for j := 0; j < b.geo.NY; j++ {
				at := b.geo.X0 + nx*((b.geo.Y0+j)+ny*(b.geo.Z0+k))
				copy(got[at:at+b.geo.NX], in[p:p+b.geo.NX])
				p += b.geo.NX
			}
		}
	})
	sameBits(t, "blocked field", got, want)
	if res != wr {
		t.Fatalf("residual %v, want %v", res, wr)
	}
	if FieldHash(h) != HashField(want) {
		t.Fatalf("hash of the blocks %d, serial %d", FieldHash(h), HashField(want))
	}
	if err := bs[0].geo.UnpackFace(bs[0].u, XHigh, make([]float64, 3)); err == nil {
		t.Fatal("UnpackFace took a face of the wrong size")
	}
}

// BenchmarkSweep times one sweep of a 16^3 block (grid 48 in 3x3x3
// blocks), of a 48^3 and a 96^3 block (the grids of the MPI comparison,
// docs/jacobi3d.md, on one rank) and of a 48x48x24 block (grid 48 on two
// ranks), in ns per point, with each kernel this CPU has.
func BenchmarkSweep(b *testing.B) {
	for _, n := range [][3]int{{16, 16, 16}, {48, 48, 48}, {96, 96, 96}, {48, 48, 24}} {
		for _, k := range kernels() {
			b.Run(fmt.Sprintf("%dx%dx%d/%s", n[0], n[1], n[2], k), func(b *testing.B) {
				blk := NewBlock(Box{NX: n[0], NY: n[1], NZ: n[2]})
				u, v := make([]float64, blk.Len()), make([]float64, blk.Len())
				for i := range u {
					u[i] = float64(i%7) / 7
				}
				withKernel(k, func() {
					b.ResetTimer()
					for b.Loop() {
						blk.Sweep(u, v)
					}
				})
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n[0]*n[1]*n[2]), "ns/point")
			})
		}
	}
}

// BenchmarkFaces packs and unpacks the six faces of a 16^3 and a 32^3
// block (grid 48 and 96 in the default 3x3x3 blocks), in ns per face point.
func BenchmarkFaces(b *testing.B) {
	for _, n := range []int{16, 32} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			blk := NewBlock(Box{NX: n, NY: n, NZ: n})
			u := make([]float64, blk.Len())
			faces := make([][]float64, NumDirs)
			points := 0
			for d := range faces {
				faces[d] = make([]float64, blk.FaceLen(d))
				points += len(faces[d])
			}
			for b.Loop() {
				for d, f := range faces {
					if err := blk.PackFaceTo(f, u, d); err != nil {
						b.Fatal(err)
					}
					if err := blk.UnpackFace(u, d, f); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(points), "ns/point")
		})
	}
}
