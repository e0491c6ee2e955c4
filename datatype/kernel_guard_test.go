//go:build linux

package datatype

import (
	"syscall"
	"testing"
	"unsafe"
)

// guarded maps n bytes that end exactly where an inaccessible page begins,
// and n bytes that start exactly after one, so that a kernel that reads or
// writes one byte past either end of its blocks faults.
func guarded(t *testing.T, n int) (atEnd, atStart []byte) {
	t.Helper()
	page := syscall.Getpagesize()
	size := (n + page - 1) / page * page
	m, err := syscall.Mmap(-1, 0, 3*page+2*size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	t.Cleanup(func() { syscall.Munmap(m) })
	// [page guard][size data A][page guard][size data B][page guard]
	for _, g := range []int{0, page + size, 2*page + 2*size} {
		if err := syscall.Mprotect(m[g:g+page], syscall.PROT_NONE); err != nil {
			t.Fatalf("mprotect: %v", err)
		}
	}
	a := m[page : page+size]
	b := m[2*page+size : 2*page+2*size]
	return a[size-n:], b[:n]
}

// TestBlocksKernelStaysInside runs the AVX2 block kernel on blocks of every
// length it takes up to 300 bytes and a few larger ones, and the REP MOVSB
// kernel on lengths around its range, with the first block starting right
// after a guard page and the last block ending right before one, on both
// the strided and the packed side. A byte too many in either direction
// faults; the copied bytes are compared with the source's.
func TestBlocksKernelStaysInside(t *testing.T) {
	if !hasBlockKernel {
		t.Skip("no assembly block kernel on this CPU or build (needs amd64 with AVX2, without the purego tag)")
	}
	lens := []int64{}
	for l := int64(65); l <= 300; l++ {
		lens = append(lens, l)
	}
	lens = append(lens, 480, 511, 512, 513, 3072, 4096, 4097, blockKernelMax)
	kernelStaysInside(t, "blocks64", blocks64, lens)
}

// TestRepKernelStaysInside is TestBlocksKernelStaysInside for blocksRep.
func TestRepKernelStaysInside(t *testing.T) {
	if !hasRepKernel {
		t.Skip("no REP MOVSB kernel on this CPU or build (needs amd64 with ERMS, without the purego tag)")
	}
	lens := []int64{1, 7, 63, 64, 65, repKernelMin - 1, repKernelMin, repKernelMin + 1, 4096, 4097, 65536 + 3, repKernelMax}
	kernelStaysInside(t, "blocksRep", blocksRep, lens)
}

func kernelStaysInside(t *testing.T, name string, kernel func(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64), lens []int64) {
	for _, l := range lens {
		for _, n := range []int64{1, 2, 7} {
			stride := l + 13
			span := (n-1)*stride + l
			// Pack: strided source ending at a guard, packed destination
			// starting after one.
			src, dst := guarded(t, int(span))
			for i := range src {
				src[i] = byte(i*7 + 3)
			}
			kernel(unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), n, l, l, stride)
			for i := int64(0); i < n; i++ {
				for j := int64(0); j < l; j++ {
					if dst[i*l+j] != src[i*stride+j] {
						t.Fatalf("%s l=%d n=%d: pack byte %d of block %d = %d, want %d", name, l, n, j, i, dst[i*l+j], src[i*stride+j])
					}
				}
			}
			// Unpack: packed source at the guard, strided destination whose
			// gaps must stay untouched.
			packed, user := guarded(t, int(span))
			for i := range packed {
				packed[i] = byte(i*5 + 1)
			}
			for i := range user {
				user[i] = 0xEE
			}
			kernel(unsafe.Pointer(&user[0]), unsafe.Pointer(&packed[len(packed)-int(n*l)]), n, l, stride, l)
			p := packed[len(packed)-int(n*l):]
			for i := int64(0); i < span; i++ {
				blk, off := i/stride, i%stride
				want := byte(0xEE)
				if off < l {
					want = p[blk*l+off]
				}
				if user[i] != want {
					t.Fatalf("%s l=%d n=%d: unpacked byte %d = %#x, want %#x", name, l, n, i, user[i], want)
				}
			}
		}
	}
}
