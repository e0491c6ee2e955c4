package actor

import (
	"encoding/binary"
	"fmt"
	"math"
)

// This file holds a small reader and writer for the subset of the msgpack
// format the envelope uses (arrays, unsigned integers, strings, binary and
// nil), and a validator that walks any msgpack value and checks every
// declared length against the bytes that remain. The validator runs before
// a body reaches the reflection decoder, so hostile lengths can never make
// the decoder allocate more than the frame holds.

// appendArrayLen appends a msgpack array header.
func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xdc, byte(n>>8), byte(n))
	default:
		return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

// appendUint appends an unsigned integer in its shortest msgpack form.
func appendUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= math.MaxUint32:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		b = append(b, 0xcf)
		return binary.BigEndian.AppendUint64(b, v)
	}
}

// appendString appends a msgpack string.
func appendString(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

// appendBin appends msgpack binary data, or nil for an empty slice.
func appendBin(b []byte, p []byte) []byte {
	n := len(p)
	switch {
	case p == nil:
		return append(b, 0xc0)
	case n <= math.MaxUint8:
		b = append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xc5, byte(n>>8), byte(n))
	default:
		b = append(b, 0xc6, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, p...)
}

// wireReader reads the envelope's msgpack subset from a byte slice. The
// first error sticks; later reads return zero values.
type wireReader struct {
	b   []byte
	off int
	err error
}

// end fails the read if bytes are left after what was read.
func (r *wireReader) end() {
	if r.err == nil && r.off != len(r.b) {
		r.fail("%d trailing bytes", len(r.b)-r.off)
	}
}

func (r *wireReader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = &DecodeError{Offset: r.off, Reason: fmt.Sprintf(format, args...)}
	}
}

func (r *wireReader) byte() byte {
	if r.err != nil {
		return 0
	}
	if r.off >= len(r.b) {
		r.fail("truncated")
		return 0
	}
	c := r.b[r.off]
	r.off++
	return c
}

// be reads an n-byte big-endian unsigned integer.
func (r *wireReader) be(n int) uint64 {
	if r.err != nil {
		return 0
	}
	if len(r.b)-r.off < n {
		r.fail("truncated %d-byte integer", n)
		return 0
	}
	var v uint64
	for _, c := range r.b[r.off : r.off+n] {
		v = v<<8 | uint64(c)
	}
	r.off += n
	return v
}

func (r *wireReader) arrayLen() int {
	c := r.byte()
	switch {
	case r.err != nil:
		return 0
	case c&0xf0 == 0x90:
		return int(c & 0x0f)
	case c == 0xdc:
		n := r.be(2)
		r.canonical(n >= 16, c)
		return int(n)
	case c == 0xdd:
		n := r.be(4)
		r.canonical(n > math.MaxUint16, c)
		return r.length(n)
	}
	r.fail("want an array, found type byte 0x%02x", c)
	return 0
}

func (r *wireReader) uint() uint64 {
	c := r.byte()
	switch {
	case r.err != nil:
		return 0
	case c < 0x80:
		return uint64(c)
	case c == 0xcc:
		v := r.be(1)
		r.canonical(v >= 0x80, c)
		return v
	case c == 0xcd:
		v := r.be(2)
		r.canonical(v > math.MaxUint8, c)
		return v
	case c == 0xce:
		v := r.be(4)
		r.canonical(v > math.MaxUint16, c)
		return v
	case c == 0xcf:
		v := r.be(8)
		r.canonical(v > math.MaxUint32, c)
		return v
	}
	r.fail("want an unsigned integer, found type byte 0x%02x", c)
	return 0
}

// canonical fails unless a value read after type byte c needed that form.
// The envelope (and credit) readers accept only the shortest encoding, the
// one appendEnvelope writes, so that an accepted header has exactly one
// wire form (FuzzDecodeEnvelope checks that it re-encodes identically).
// The body validator (skip) is not affected: any msgpack encoder may write
// bodies.
func (r *wireReader) canonical(ok bool, c byte) {
	if !ok {
		r.fail("type byte 0x%02x for a value with a shorter encoding", c)
	}
}

// canonicalLen is canonical for a length that must be at least min.
func (r *wireReader) canonicalLen(n uint64, min uint64, c byte) uint64 {
	r.canonical(n >= min, c)
	return n
}

// length checks a declared length against the remaining bytes.
func (r *wireReader) length(n uint64) int {
	if r.err != nil {
		return 0
	}
	if n > uint64(len(r.b)-r.off) {
		r.fail("declared length %d exceeds the %d bytes left", n, len(r.b)-r.off)
		return 0
	}
	return int(n)
}

func (r *wireReader) raw(n int) []byte {
	if r.err != nil {
		return nil
	}
	p := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return p
}

func (r *wireReader) string() string { return string(r.stringRaw()) }

// stringRaw reads a string; the result aliases the input.
func (r *wireReader) stringRaw() []byte {
	c := r.byte()
	var n int
	switch {
	case r.err != nil:
		return nil
	case c&0xe0 == 0xa0:
		n = r.length(uint64(c & 0x1f))
	case c == 0xd9:
		n = r.length(r.canonicalLen(r.be(1), 32, c))
	case c == 0xda:
		n = r.length(r.canonicalLen(r.be(2), math.MaxUint8+1, c))
	case c == 0xdb:
		n = r.length(r.canonicalLen(r.be(4), math.MaxUint16+1, c))
	default:
		r.fail("want a string, found type byte 0x%02x", c)
		return nil
	}
	return r.raw(n)
}

// bin reads binary data or nil; the result aliases the input.
func (r *wireReader) bin() []byte {
	c := r.byte()
	var n int
	switch {
	case r.err != nil:
		return nil
	case c == 0xc0:
		return nil
	case c == 0xc4:
		n = r.length(r.be(1))
	case c == 0xc5:
		n = r.length(r.canonicalLen(r.be(2), math.MaxUint8+1, c))
	case c == 0xc6:
		n = r.length(r.canonicalLen(r.be(4), math.MaxUint16+1, c))
	default:
		r.fail("want binary data, found type byte 0x%02x", c)
		return nil
	}
	return r.raw(n)
}

// maxDepth bounds the nesting the validator accepts.
const maxDepth = 64

// validateMsgpack checks that b holds exactly one well-formed msgpack value
// whose every declared length (bytes, or elements at one byte each at
// least) fits in what remains of b.
func validateMsgpack(b []byte) error {
	r := &wireReader{b: b}
	r.skip(0)
	r.end()
	return r.err
}

func (r *wireReader) skip(depth int) {
	if depth > maxDepth {
		r.fail("nested deeper than %d", maxDepth)
		return
	}
	c := r.byte()
	if r.err != nil {
		return
	}
	elems := 0 // nested values to skip
	switch {
	case c < 0x80 || c >= 0xe0: // fixints
	case c&0xf0 == 0x80: // fixmap
		elems = 2 * int(c&0x0f)
	case c&0xf0 == 0x90: // fixarray
		elems = int(c & 0x0f)
	case c&0xe0 == 0xa0: // fixstr
		r.raw(r.length(uint64(c & 0x1f)))
	case c == 0xc0, c == 0xc2, c == 0xc3: // nil, false, true
	case c == 0xc4, c == 0xd9: // bin8, str8
		r.raw(r.length(r.be(1)))
	case c == 0xc5, c == 0xda:
		r.raw(r.length(r.be(2)))
	case c == 0xc6, c == 0xdb:
		r.raw(r.length(r.be(4)))
	case c == 0xc7, c == 0xc8, c == 0xc9: // ext8/16/32
		n := r.be(1 << (c - 0xc7))
		r.raw(r.length(n + 1))
	case c == 0xca, c == 0xce, c == 0xd2: // float32, uint32, int32
		r.raw(r.length(4))
	case c == 0xcb, c == 0xcf, c == 0xd3: // float64, uint64, int64
		r.raw(r.length(8))
	case c == 0xcc, c == 0xd0:
		r.raw(r.length(1))
	case c == 0xcd, c == 0xd1:
		r.raw(r.length(2))
	case c >= 0xd4 && c <= 0xd8: // fixext 1..16
		r.raw(r.length(1 + 1<<(c-0xd4)))
	case c == 0xdc:
		elems = r.length(r.be(2))
	case c == 0xdd:
		elems = r.length(r.be(4))
	case c == 0xde:
		elems = 2 * r.length(r.be(2))
	case c == 0xdf:
		elems = 2 * r.length(r.be(4))
	default:
		r.fail("invalid type byte 0x%02x", c)
	}
	for i := 0; i < elems && r.err == nil; i++ {
		r.skip(depth + 1)
	}
}
