// Package layouts builds the thirteen benchmark layouts of troupe's
// derived-datatype benchmarks (modelled on DDTBench: MILC, NAS MG, WRF,
// SPECFEM3D, FFT, LAMMPS and plain vectors) exactly as
// shared/ddt-layouts.md specifies them, and measures pack and unpack
// bandwidth against copy.
package layouts

import (
	"fmt"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// Layout is one benchmark layout: count = 1 element of Type packed from a
// source allocation of Alloc bytes whose origin is at byte Base.
type Layout struct {
	Name   string
	Type   *dt.Type
	Alloc  int64 // bytes of the source allocation
	Base   int64 // byte offset of the origin in the allocation
	Packed int64 // expected packed bytes (from the table)
}

// Names lists the layouts in table order.
var Names = []string{"milc_zd", "nas_mg_x", "nas_mg_y", "nas_mg_z", "wrf_y_vec", "wrf_y_sa",
	"specfem3d_mt", "fft", "fft_tr", "lammps_full", "vec_64B", "vec_4KiB", "vec_64B_big"}

// Fill writes the reference pattern: the byte at base+d is (d*131+7) mod 256
// for every d, including negative d before the origin.
func Fill(buf []byte, base int64) {
	// The pattern has period 256 in d: compute one period, then double.
	n := min(len(buf), 256)
	for i := 0; i < n; i++ {
		d := int64(i) - base
		buf[i] = byte(((d*131+7)%256 + 256) % 256)
	}
	for done := n; done < len(buf); done *= 2 {
		copy(buf[done:], buf[:done])
	}
}

// All builds every layout in table order.
func All() ([]Layout, error) {
	out := make([]Layout, 0, len(Names))
	for _, n := range Names {
		l, err := Build(n)
		if err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, nil
}

// builder chains constructor calls and keeps the first error.
type builder struct{ err error }

func (b *builder) t(t *dt.Type, err error) *dt.Type {
	if b.err == nil && err != nil {
		b.err = err
	}
	return t
}

const nasAlloc = 514 * 258 * 258 * 8

// WRF array offsets and sizes (float32; i fastest, then k, then j).
var (
	wrf2D = []int64{0, 27456, 54912, 82368}
	wrf3D = []int64{109824, 1894464, 3679104}
	wrf4D = []int64{5463744, 9033024}
)

// LammpsList returns the atom index list of lammps_full:
// list[j] = 5j + ((7j^2+3j) mod 5), j < 6000.
func LammpsList() []int64 {
	l := make([]int64, 6000)
	for j := range l {
		jj := int64(j)
		l[j] = 5*jj + (7*jj*jj+3*jj)%5
	}
	return l
}

// Build builds the named layout.
func Build(name string) (Layout, error) {
	var b builder
	f32, f64 := dt.Float32, dt.Float64
	l := Layout{Name: name}
	switch name {
	case "milc_zd":
		su3 := b.t(dt.Contiguous(6, f32))
		in := b.t(dt.Vector(64, 128, 2048, su3))
		l.Type = b.t(dt.HVector(2, 1, 3145728, in))
		l.Alloc, l.Packed = 6291456, 393216
	case "nas_mg_x":
		col := b.t(dt.Vector(256, 1, 514, f64))
		l.Type = b.t(dt.HVector(256, 1, 1060896, col))
		l.Alloc, l.Base, l.Packed = nasAlloc, 8*(512+514*(1+258*1)), 524288
	case "nas_mg_y":
		l.Type = b.t(dt.Vector(256, 512, 132612, f64))
		l.Alloc, l.Base, l.Packed = nasAlloc, 8*(1+514*(256+258*1)), 1048576
	case "nas_mg_z":
		l.Type = b.t(dt.Vector(256, 512, 514, f64))
		l.Alloc, l.Base, l.Packed = nasAlloc, 8*(1+514*(1+258*1)), 1048576
	case "wrf_y_vec":
		t2 := b.t(dt.Vector(3, 120, 132, f32))
		t3 := b.t(dt.HVector(3, 1, 34320, b.t(dt.Vector(65, 120, 132, f32))))
		t4 := b.t(dt.HVector(1, 1, 1784640, t3))
		var types []*dt.Type
		var disps []int64
		for _, o := range wrf2D {
			types, disps = append(types, t2), append(disps, o+3716)
		}
		for _, o := range wrf3D {
			types, disps = append(types, t3), append(disps, o+240260)
		}
		for _, o := range wrf4D {
			types, disps = append(types, t4), append(disps, o+2024900)
		}
		l.Type = b.t(dt.Struct(ones(9), disps, types))
		l.Alloc, l.Packed = 12602304, 473760
	case "wrf_y_sa":
		t2 := b.t(dt.Subarray([]int64{132, 52}, []int64{120, 3}, []int64{5, 7}, dt.OrderFortran, f32))
		t3 := b.t(dt.Subarray([]int64{132, 65, 52}, []int64{120, 65, 3}, []int64{5, 0, 7}, dt.OrderFortran, f32))
		t4 := b.t(dt.Subarray([]int64{132, 65, 52, 2}, []int64{120, 65, 3, 1}, []int64{5, 0, 7, 1}, dt.OrderFortran, f32))
		var types []*dt.Type
		var disps []int64
		for _, o := range wrf2D {
			types, disps = append(types, t2), append(disps, o)
		}
		for _, o := range wrf3D {
			types, disps = append(types, t3), append(disps, o)
		}
		for _, o := range wrf4D {
			types, disps = append(types, t4), append(disps, o)
		}
		l.Type = b.t(dt.Struct(ones(9), disps, types))
		l.Alloc, l.Packed = 12602304, 473760
	case "specfem3d_mt":
		l.Type = b.t(dt.Vector(40000, 1, 2, b.t(dt.Contiguous(3, f32))))
		l.Alloc, l.Packed = 960000, 480000
	case "fft":
		c := b.t(dt.Contiguous(2, f64))
		l.Type = b.t(dt.Resized(b.t(dt.Vector(256, 256, 1024, c)), 0, 4096))
		l.Alloc, l.Packed = 4194304, 1048576
	case "fft_tr":
		c := b.t(dt.Contiguous(2, f64))
		col := b.t(dt.Resized(b.t(dt.Vector(256, 1, 1024, c)), 0, 16))
		l.Type = b.t(dt.Contiguous(256, col))
		l.Alloc, l.Packed = 4194304, 1048576
	case "lammps_full":
		list := LammpsList()
		x3 := make([]int64, len(list))
		for j, v := range list {
			x3[j] = 3 * v
		}
		three := make([]int64, len(list))
		for j := range three {
			three[j] = 3
		}
		tx := b.t(dt.Indexed(three, x3, f64))
		t1 := b.t(dt.Indexed(ones(len(list)), list, f64))
		types := []*dt.Type{tx, t1, t1, t1, t1, t1}
		l.Type = b.t(dt.Struct(ones(6), []int64{0, 720000, 960000, 1200000, 1440000, 1680000}, types))
		l.Alloc, l.Packed = 1920000, 384000
	case "vec_64B":
		l.Type = b.t(dt.Vector(64, 8, 16, f64))
		l.Alloc, l.Packed = 8128, 4096
	case "vec_4KiB":
		l.Type = b.t(dt.Vector(64, 512, 1024, f64))
		l.Alloc, l.Packed = 520192, 262144
	case "vec_64B_big":
		l.Type = b.t(dt.Vector(8192, 8, 16, f64))
		l.Alloc, l.Packed = 1048512, 524288
	default:
		return Layout{}, fmt.Errorf("layouts: unknown layout %q", name)
	}
	if b.err != nil {
		return Layout{}, fmt.Errorf("layouts: %s: %w", name, b.err)
	}
	return l, nil
}

func ones(n int) []int64 {
	o := make([]int64, n)
	for i := range o {
		o[i] = 1
	}
	return o
}
