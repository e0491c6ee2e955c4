package bootstrap

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"reflect"
	"testing"
)

// FuzzReadFrame: reading any bytes as a rendezvous frame never panics and
// reads no further than the frame; a frame read encodes to one that reads
// back equal; a failure is the reader's end of input, errFrameTooLarge or
// errMalformedFrame.
func FuzzReadFrame(f *testing.F) {
	lost := 2
	for _, fr := range []*frame{
		{Op: opJoin, Version: protocolVersion, Token: "0123456789abcdef", Rank: 1, Size: 4, Notify: true},
		{Op: opOK},
		{Op: opGather, Rank: 3, Key: "ag:addr", Value: []byte{0, 1, 2, 0xff}},
		{Op: opResult, Key: "ag:addr", Values: [][]byte{{1}, nil, {}, []byte("x")}},
		{Op: opError, Key: "b:1", Error: "rank 2 lost", Lost: &lost},
		{Op: opLost, Lost: &lost, Error: "connection reset"},
		{Op: opBye},
	} {
		b, err := encodeFrame(fr)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0, 0, 0, 4, 'n', 'u', 'l', 'l'})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		fr, err := readFrameMax(r, maxJoinFrame)
		if err != nil {
			if fr != nil {
				t.Fatalf("frame %+v with error %v", fr, err)
			}
			if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) &&
				!errors.Is(err, errFrameTooLarge) && !errors.Is(err, errMalformedFrame) {
				t.Fatalf("error %v of no documented kind", err)
			}
			return
		}
		n := int(binary.BigEndian.Uint32(b))
		if n > maxJoinFrame {
			t.Fatalf("read a frame of %d bytes, limit %d", n, maxJoinFrame)
		}
		if r.Len() != len(b)-4-n {
			t.Fatalf("read %d bytes for a frame of %d", len(b)-r.Len(), 4+n)
		}
		enc, err := encodeFrame(fr)
		if err != nil {
			t.Fatalf("encoding frame %+v read: %v", fr, err)
		}
		back, err := readFrame(bytes.NewReader(enc))
		if err != nil {
			t.Fatalf("reading back %q: %v", enc, err)
		}
		norm := func(f *frame) {
			if len(f.Value) == 0 {
				f.Value = nil
			}
			if len(f.Values) == 0 {
				f.Values = nil
			}
		}
		norm(fr)
		norm(back)
		if !reflect.DeepEqual(fr, back) {
			t.Fatalf("frame %+v read back as %+v", fr, back)
		}
	})
}
