//go:build amd64 && !purego

#include "textflag.h"

// func blocks64(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64)
//
// Copies n blocks of l > 64 bytes. Blocks of at least 128 bytes move in
// 128-byte chunks of four YMM registers, and last the 128 bytes ending at
// the block's end (they may overlap the previous chunk). From 256 bytes on
// the first 32 bytes move first and the chunks start at the destination's
// first 32-byte boundary after them, so that no chunk store splits a cache
// line when the destination is misaligned, as an unpack's user buffer
// often is (480-byte blocks unpacked at 28 GB/s instead of 22 on an Intel
// VM, 2026-12-06; at 128 bytes the extra store cost more). Blocks of 65..127 bytes
// move as the first 64 and the last 64 bytes. No load or store reaches
// outside [0, l) of a block.
TEXT ·blocks64(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ l+24(FP), DX
	MOVQ dstStride+32(FP), R8
	MOVQ srcStride+40(FP), R9
	TESTQ CX, CX
	JLE done
	CMPQ DX, $128
	JLT short
	LEAQ -128(DX), BX

block:
	XORQ AX, AX
	CMPQ DX, $256
	JLT chunk // below 256 bytes the extra head store costs more than split stores
	VMOVDQU 0(SI), Y0
	VMOVDQU Y0, 0(DI)
	MOVQ DI, AX
	ANDQ $31, AX
	NEGQ AX
	ADDQ $32, AX // 32 - dst%32: 1..32, the first aligned offset past the head

chunk:
	CMPQ AX, BX
	JGE tail
	VMOVDQU 0(SI)(AX*1), Y0
	VMOVDQU 32(SI)(AX*1), Y1
	VMOVDQU 64(SI)(AX*1), Y2
	VMOVDQU 96(SI)(AX*1), Y3
	VMOVDQU Y0, 0(DI)(AX*1)
	VMOVDQU Y1, 32(DI)(AX*1)
	VMOVDQU Y2, 64(DI)(AX*1)
	VMOVDQU Y3, 96(DI)(AX*1)
	ADDQ $128, AX
	JMP chunk

tail:
	VMOVDQU 0(SI)(BX*1), Y0
	VMOVDQU 32(SI)(BX*1), Y1
	VMOVDQU 64(SI)(BX*1), Y2
	VMOVDQU 96(SI)(BX*1), Y3
	VMOVDQU Y0, 0(DI)(BX*1)
	VMOVDQU Y1, 32(DI)(BX*1)
	VMOVDQU Y2, 64(DI)(BX*1)
	VMOVDQU Y3, 96(DI)(BX*1)
	ADDQ R8, DI
	ADDQ R9, SI
	DECQ CX
	JNZ block
	VZEROUPPER
	RET

short:
	LEAQ -64(DX), BX

shortloop:
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 0(SI)(BX*1), Y2
	VMOVDQU 32(SI)(BX*1), Y3
	VMOVDQU Y0, 0(DI)
	VMOVDQU Y1, 32(DI)
	VMOVDQU Y2, 0(DI)(BX*1)
	VMOVDQU Y3, 32(DI)(BX*1)
	ADDQ R8, DI
	ADDQ R9, SI
	DECQ CX
	JNZ shortloop
	VZEROUPPER

done:
	RET

// func blocksRep(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64)
//
// Copies n blocks of l bytes with one REP MOVSB per block: on CPUs with
// enhanced REP MOVSB (ERMS) the microcode moves whole cache lines and beats
// a vector loop from about 4 KiB on. It touches exactly the blocks' bytes.
TEXT ·blocksRep(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), R10
	MOVQ src+8(FP), R11
	MOVQ n+16(FP), R12
	MOVQ l+24(FP), DX
	MOVQ dstStride+32(FP), R8
	MOVQ srcStride+40(FP), R9
	TESTQ R12, R12
	JLE repdone

repblock:
	MOVQ R10, DI
	MOVQ R11, SI
	MOVQ DX, CX
	REP; MOVSB
	ADDQ R8, R10
	ADDQ R9, R11
	DECQ R12
	JNZ repblock

repdone:
	RET

// func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)
TEXT ·cpuid(SB), NOSPLIT, $0-24
	MOVL eaxArg+0(FP), AX
	MOVL ecxArg+4(FP), CX
	CPUID
	MOVL AX, eax+8(FP)
	MOVL BX, ebx+12(FP)
	MOVL CX, ecx+16(FP)
	MOVL DX, edx+20(FP)
	RET
