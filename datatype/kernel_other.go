//go:build !amd64 || purego

package datatype

import "unsafe"

// hasBlockKernel is false: only amd64 has an assembly block kernel.
const hasBlockKernel = false

// hasRepKernel is false: only amd64 has a REP MOVSB kernel.
const hasRepKernel = false

// repKernel is false: there is no REP MOVSB kernel to use.
func repKernel() bool { return false }

// setRepKernel cannot turn on a kernel that is not there.
func setRepKernel(bool) bool { return false }

// blocksRep is never called where hasRepKernel is false.
func blocksRep(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64) {
	blocks64(dst, src, n, l, dstStride, srcStride)
}

// blocks64 is never called where hasBlockKernel is false.
func blocks64(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64) {
	for i := int64(0); i < n; i++ {
		copy(unsafe.Slice((*byte)(unsafe.Add(dst, i*dstStride)), l),
			unsafe.Slice((*byte)(unsafe.Add(src, i*srcStride)), l))
	}
}
