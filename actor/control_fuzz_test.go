package actor

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// Fuzz targets of the control-message decoders (control.go): no panic; a
// header accepted names a rank of the job, carries reasons within
// maxAckReason and re-encodes (with the senders' appendUint and
// appendString) to exactly its input; a header refused gives a
// *DecodeError. A reason longer than maxAckReason (its senders clip it)
// reads cut to that length.

func wantDecodeError(t *testing.T, err error) {
	t.Helper()
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("error %v (%T) is not a *DecodeError", err, err)
	}
}

// FuzzCreditHeader: the credit message inPeer.credit sends.
func FuzzCreditHeader(f *testing.F) {
	for _, s := range [][2]uint64{{0, 64}, {fuzzRanks - 1, 1 << 20}, {3, 0}, {200, 5}} {
		f.Add(appendUint(appendUint(nil, s[0]), s[1]))
	}
	f.Add([]byte{0x01, 0xcc, 0x05}) // a count in a longer form than needed
	f.Fuzz(func(t *testing.T, b []byte) {
		src, n, err := decodeCredit(b, fuzzRanks)
		if err != nil {
			wantDecodeError(t, err)
			return
		}
		if src < 0 || src >= fuzzRanks {
			t.Fatalf("accepted rank %d of %d", src, fuzzRanks)
		}
		if again := appendUint(appendUint(nil, uint64(src)), n); !bytes.Equal(again, b) {
			t.Fatalf("accepted %x, which re-encodes as %x", b, again)
		}
	})
}

// FuzzDeviceReplyHeader: the headers of device acknowledgements
// (ackDevice), requests for a declined message's bytes (fetchDeclined)
// and those bytes (resendBytes).
func FuzzDeviceReplyHeader(f *testing.F) {
	for _, c := range []struct {
		src, seq uint64
		reason   string
	}{
		{1, 7, ""},
		{fuzzRanks - 1, 1<<64 - 1, "device payload: PostReceiveDevice buffer of 64 bytes for 128"},
		{0, 1 << 40, strings.Repeat("r", maxAckReason)},
		{5, 9, strings.Repeat("long", maxAckReason)}, // longer than its senders send
		{fuzzRanks, 1, "no such rank"},
	} {
		f.Add(appendString(appendUint(appendUint(nil, c.src), c.seq), c.reason))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		src, seq, reason, err := decodeDeviceReply(b, fuzzRanks)
		if err != nil {
			wantDecodeError(t, err)
			return
		}
		r := &wireReader{b: b}
		r.uint()
		r.uint()
		full := r.string()
		checkAcceptedReply(t, b, src, reason, full, appendString(appendUint(appendUint(nil, uint64(src)), seq), full))
	})
}

// checkAcceptedReply checks a device reply or rejection header b that
// decoded to rank src and reason: the rank is one of the job's, the reason
// is full (the reason on the wire) clipped to maxAckReason, and again (the
// header encoded anew from what was read) is b.
func checkAcceptedReply(t *testing.T, b []byte, src int, reason, full string, again []byte) {
	t.Helper()
	if src < 0 || src >= fuzzRanks || len(reason) > maxAckReason {
		t.Fatalf("accepted rank %d of %d, reason of %d bytes", src, fuzzRanks, len(reason))
	}
	if reason != clipReason(full) {
		t.Fatalf("reason %q read for %q", reason, full)
	}
	if !bytes.Equal(again, b) {
		t.Fatalf("accepted %x, which re-encodes as %x", b, again)
	}
}

// FuzzDeviceRejectedHeader: the device rejection rejectDevice sends.
func FuzzDeviceRejectedHeader(f *testing.F) {
	for _, c := range []struct {
		src            uint64
		target, reason string
	}{
		{2, "sink", "device payload: no device memory"},
		{0, "array/17", strings.Repeat("x", maxAckReason)},
		{fuzzRanks - 1, "", ""},
		{1, "t", strings.Repeat("long", maxAckReason)},
	} {
		f.Add(appendString(appendString(appendUint(nil, c.src), c.target), c.reason))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		src, target, reason, err := decodeDeviceRejected(b, fuzzRanks)
		if err != nil {
			wantDecodeError(t, err)
			return
		}
		r := &wireReader{b: b}
		r.uint()
		r.string()
		full := r.string()
		checkAcceptedReply(t, b, src, reason, full, appendString(appendString(appendUint(nil, uint64(src)), target), full))
	})
}
