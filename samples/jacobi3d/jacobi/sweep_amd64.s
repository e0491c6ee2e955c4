//go:build !purego

#include "textflag.h"

// The registers the kernels share: SI the point; R10 v - u in bytes (a
// point of v is at (SI)(R10*1)); R8 sx*8, R11 -sx*8, R9 sxy*8, R12 -sxy*8;
// X14/Y14/Z14 the |x| mask, X15/Y15/Z15 c7.

// LOAD_ARGS loads a kernel's arguments (both kernels have sweepAVX2's):
// R10 v - u in bytes, R14 u, CX nx*8, BX nz, R8 sx*8, R9 sxy*8, R11 -sx*8,
// R12 -sxy*8.
#define LOAD_ARGS \
	MOVQ v+0(FP), R10 \
	MOVQ u+8(FP), R14 \
	SUBQ R14, R10 \
	MOVQ nx+16(FP), CX \
	MOVQ nz+32(FP), BX \
	MOVQ sx+40(FP), R8 \
	MOVQ sxy+48(FP), R9 \
	SHLQ $3, R8 \
	SHLQ $3, R9 \
	MOVQ R8, R11 \
	NEGQ R11 \
	MOVQ R9, R12 \
	NEGQ R12 \
	SHLQ $3, CX

// MAX_INTO_X0 leaves the largest of Y0's four maxima and X5's in X0.
#define MAX_INTO_X0 \
	VEXTRACTF128 $1, Y0, X1 \
	VMAXPD X1, X0, X0 \
	VPERMILPD $1, X0, X1 \
	VMAXPD X1, X0, X0 \
	VMAXSD X5, X0, X0 \
	VZEROUPPER

// SCALAR_POINT sweeps the point at SI into the running maximum X5.
#define SCALAR_POINT \
	VMOVSD (SI), X1 \
	VADDSD -8(SI), X1, X2 \
	VADDSD 8(SI), X2, X2 \
	VADDSD (SI)(R11*1), X2, X2 \
	VADDSD (SI)(R8*1), X2, X2 \
	VADDSD (SI)(R12*1), X2, X2 \
	VADDSD (SI)(R9*1), X2, X2 \
	VMULSD X15, X2, X2 \
	VMOVSD X2, (SI)(R10*1) \
	VSUBSD X1, X2, X3 \
	VANDPD X14, X3, X3 \
	VMAXSD X5, X3, X5

// YMM_POINTS sweeps the four points from SI into the running maxima max.
#define YMM_POINTS(max) \
	VMOVUPD (SI), Y1 \
	VADDPD -8(SI), Y1, Y2 \
	VADDPD 8(SI), Y2, Y2 \
	VADDPD (SI)(R11*1), Y2, Y2 \
	VADDPD (SI)(R8*1), Y2, Y2 \
	VADDPD (SI)(R12*1), Y2, Y2 \
	VADDPD (SI)(R9*1), Y2, Y2 \
	VMULPD Y15, Y2, Y2 \
	VMOVUPD Y2, (SI)(R10*1) \
	VSUBPD Y1, Y2, Y3 \
	VANDPD Y14, Y3, Y3 \
	VMAXPD max, Y3, max

// func sweepAVX2(v, u *float64, nx, ny, nz, sx, sxy int, r, c7 float64) float64
//
// v and u point at the first point of the box to sweep (a block's whole
// interior, or part of it: Block.SweepPart). Four points per step, in the
// reference's order of operations, each add and the multiply rounded
// separately (no FMA); a row's last nx%4 points one at a time. The
// residual is kept as a vector of running maxima: VMAXPD returns its
// second source when the other is NaN, so, as in the Go loop, a NaN change
// never becomes the residual.
//
// Registers: R14 the plane's first point in u, DI the row's, SI the point's;
// R10 v - u in bytes (a point of v is at (SI)(R10*1)); R8 sx*8, R11 -sx*8,
// R9 sxy*8, R12 -sxy*8; CX nx*8; R13 (nx&^3)*8; AX the end of the row's
// vector part, then of the row; DX rows left in the plane; BX planes left.
// Y0 running maxima (vector part), X5 running maximum (tails), Y14 the |x|
// mask, Y15 c7.
TEXT ·sweepAVX2(SB), NOSPLIT, $0-80
	LOAD_ARGS
	MOVQ CX, R13
	ANDQ $-32, R13
	VBROADCASTSD r+56(FP), Y0
	VMOVSD r+56(FP), X5
	VBROADCASTSD c7+64(FP), Y15
	VPCMPEQQ Y14, Y14, Y14
	VPSRLQ $1, Y14, Y14

plane:
	TESTQ BX, BX
	JLE done
	MOVQ ny+24(FP), DX
	MOVQ R14, DI

row:
	TESTQ DX, DX
	JLE nextplane
	MOVQ DI, SI
	LEAQ (DI)(R13*1), AX

vec:
	CMPQ SI, AX
	JAE tail
	YMM_POINTS(Y0)
	ADDQ $32, SI
	JMP vec

tail:
	LEAQ (DI)(CX*1), AX

tailloop:
	CMPQ SI, AX
	JAE nextrow
	SCALAR_POINT
	ADDQ $8, SI
	JMP tailloop

nextrow:
	ADDQ R8, DI
	DECQ DX
	JMP row

nextplane:
	ADDQ R9, R14
	DECQ BX
	JMP plane

done:
	MAX_INTO_X0
	MOVSD X0, ret+72(FP)
	RET

// func sweepAVX512(v, u *float64, nx, ny, nz, sx, sxy int, r, c7 float64) float64
//
// sweepAVX2 with eight points per step in ZMM registers (AVX-512F), then at
// most one step of four and the last nx%4 points one at a time: the same
// operations on each point in the same order, so the same bits, with half
// the instructions per point and one branch per step. A row of 64 points
// or more starts with single points up to a 64-byte boundary, so that the
// steps' loads of the point and its store do not straddle two lines
// (BenchmarkSweep, 96^3: 0.68-0.72 ns a point unaligned, 0.43-0.46
// aligned, AVX2 0.51-0.55); in shorter rows those points cost more than
// they save.
//
// Registers as in sweepAVX2, and: AX the row's end, R13 the last start of
// a full step; Z0 running maxima of the eight-wide steps, Y6 of the
// four-wide one, X5 of single points.
TEXT ·sweepAVX512(SB), NOSPLIT, $0-80
	LOAD_ARGS
	VBROADCASTSD r+56(FP), Z0
	VBROADCASTSD r+56(FP), Y6
	VMOVSD r+56(FP), X5
	VBROADCASTSD c7+64(FP), Z15
	MOVQ $0x7fffffffffffffff, AX
	VPBROADCASTQ AX, Z14

plane512:
	TESTQ BX, BX
	JLE done512
	MOVQ ny+24(FP), DX
	MOVQ R14, DI

row512:
	TESTQ DX, DX
	JLE nextplane512
	MOVQ DI, SI
	LEAQ (DI)(CX*1), AX
	CMPQ CX, $512
	JB aligned512

head512:
	TESTQ $63, SI
	JZ aligned512
	CMPQ SI, AX
	JAE nextrow512
	SCALAR_POINT
	ADDQ $8, SI
	JMP head512

aligned512:
	LEAQ -64(AX), R13
	CMPQ SI, R13
	JA vec4

vec8:
	VMOVUPD (SI), Z1
	VADDPD -8(SI), Z1, Z2
	VADDPD 8(SI), Z2, Z2
	VADDPD (SI)(R11*1), Z2, Z2
	VADDPD (SI)(R8*1), Z2, Z2
	VADDPD (SI)(R12*1), Z2, Z2
	VADDPD (SI)(R9*1), Z2, Z2
	VMULPD Z15, Z2, Z2
	VMOVUPD Z2, (SI)(R10*1)
	VSUBPD Z1, Z2, Z3
	VPANDQ Z14, Z3, Z3
	VMAXPD Z0, Z3, Z0
	ADDQ $64, SI
	CMPQ SI, R13
	JBE vec8

vec4:
	LEAQ -32(AX), R13
	CMPQ SI, R13
	JA tail512
	YMM_POINTS(Y6)
	ADDQ $32, SI

tail512:
	CMPQ SI, AX
	JAE nextrow512
	SCALAR_POINT
	ADDQ $8, SI
	JMP tail512

nextrow512:
	ADDQ R8, DI
	DECQ DX
	JMP row512

nextplane512:
	ADDQ R9, R14
	DECQ BX
	JMP plane512

done512:
	VEXTRACTF64X4 $1, Z0, Y1
	VMAXPD Y1, Y0, Y0
	VMAXPD Y6, Y0, Y0
	MAX_INTO_X0
	MOVSD X0, ret+72(FP)
	RET
