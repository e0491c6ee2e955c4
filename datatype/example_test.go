package datatype_test

import (
	"fmt"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// A column of a 4x4 row-major matrix of float64 is a vector of 4 blocks of 1
// element, 4 elements apart.
func ExampleVector() {
	col, err := dt.Vector(4, 1, 4, dt.Float64)
	if err != nil {
		panic(err)
	}
	tm, _ := col.Typemap(1)
	fmt.Println(col.Size(), col.Extent(), tm)
	// Output: 32 104 [{0 8} {32 8} {64 8} {96 8}]
}

// Pack gathers the typemap's bytes into a contiguous buffer; Unpack scatters
// them back, leaving other bytes untouched.
func ExampleType_Pack() {
	col, _ := dt.Vector(3, 1, 3, dt.Uint8) // bytes 0, 3, 6
	src := []byte("abcdefghi")
	packed := make([]byte, 3)
	n, _ := col.Pack(packed, src, 0, 1)
	fmt.Println(n, string(packed))
	dst := []byte(".........")
	col.Unpack(dst, packed, 0, 1)
	fmt.Println(string(dst))
	// Output:
	// 3 adg
	// a..d..g..
}

// PackRange produces the packed stream in pieces, like a convertor feeding a
// pipeline of fixed-size chunks.
func ExampleType_PackRange() {
	v, _ := dt.Vector(4, 2, 3, dt.Uint8) // "ab" "de" "gh" "jk"
	src := []byte("abcdefghijkl")
	chunk := make([]byte, 3)
	for off := int64(0); ; {
		n, _ := v.PackRange(chunk, src, 0, 1, off)
		if n == 0 {
			break
		}
		fmt.Printf("%q ", chunk[:n])
		off += n
	}
	fmt.Println()
	// Output: "abd" "egh" "jk"
}

// An Iterator returns the segments of the next piece of the packed stream,
// bounded in bytes and in segments (for example a NIC's scatter/gather
// entries per operation).
func ExampleIterator_Next() {
	v, _ := dt.Vector(5, 1, 2, dt.Int32) // 4 bytes every 8
	it, _ := v.NewIterator(1)
	buf := make([]dt.Segment, 2)
	for !it.Done() {
		segs, n := it.Next(buf, 1<<20)
		fmt.Println(segs, n)
	}
	// Output:
	// [{0 4} {8 4}] 8
	// [{16 4} {24 4}] 8
	// [{32 4}] 4
}

// Sender and receiver may use different layouts with the same type
// signature; the signature hashes tell whether they match.
func ExampleType_SignatureHash() {
	send, _ := dt.Vector(8, 1, 2, dt.Float64)
	recv, _ := dt.Contiguous(4, dt.Float64)
	s, _ := send.SignatureHash(1)
	r, _ := recv.SignatureHash(2)
	bad, _ := dt.Contiguous(8, dt.Int64)
	b, _ := bad.SignatureHash(1)
	fmt.Println(s == r, s == b)
	// Output: true false
}

// The layout cache flattens (type, base address, count) once and keeps the
// statistics a transfer-scheme selector needs.
func ExampleLayoutCache_Get() {
	c := dt.NewLayoutCache(1 << 16)
	face, _ := dt.Vector(64, 512, 1024, dt.Float64) // 64 blocks of 4 KiB
	l, _ := c.Get(face, 0x10000, 1)
	fmt.Printf("%d segments, min %d, avg %.0f, max %d bytes\n",
		l.Stats.Segments, l.Stats.MinBlock, l.Stats.AvgBlock, l.Stats.MaxBlock)
	face.Free() // evicts the layout
	fmt.Println(c.Stats().Entries)
	// Output:
	// 64 segments, min 4096, avg 4096, max 4096 bytes
	// 0
}

// Subarray describes a block of an n-dimensional array; its extent is the
// whole array.
func ExampleSubarray() {
	// Rows 1-2, columns 2-4 of a 4x5 row-major int32 array.
	sub, _ := dt.Subarray([]int64{4, 5}, []int64{2, 3}, []int64{1, 2}, dt.OrderC, dt.Int32)
	tm, _ := sub.Typemap(1)
	fmt.Println(sub.Size(), sub.LB(), sub.Extent(), tm)
	// Output: 24 0 80 [{28 12} {48 12}]
}

// The x face of a large 3-D grid is page-bound: 8-byte elements a page apart
// over 64 MiB. Workers says how many goroutines pay for it (here up to the
// limit of 4), and PackParallel packs the same bytes as PackRaw with them.
// A layout that fits the caches gets one.
func ExampleType_PackParallel() {
	face, _ := dt.Vector(1<<14, 1, 512, dt.Float64) // 16384 elements 4 KiB apart
	small, _ := dt.Vector(64, 1, 512, dt.Float64)
	fmt.Println(face.Workers(1, 4), small.Workers(1, 4))

	grid := make([]byte, face.Extent())
	for i := range grid {
		grid[i] = byte(i / 4096)
	}
	packed := make([]byte, 128<<10)
	n, err := face.PackParallel(dt.SliceRegion(packed), dt.SliceRegion(grid), 0, 1, 0, face.Workers(1, 4))
	fmt.Println(n, err, packed[8], packed[8*255], packed[8*256])
	// Output:
	// 4 1
	// 131072 <nil> 1 255 0
}
