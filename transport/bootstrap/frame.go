package bootstrap

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// MaxFrameSize bounds every frame of the rendezvous protocol, in both
// directions. A larger length prefix is rejected without reading the payload;
// an AllGather whose combined result would exceed it fails with an error.
const MaxFrameSize = 16 << 20

// protocolVersion is sent in the join frame; a server rejects other versions.
const protocolVersion = 1

// Frame operations.
const (
	opJoin   = "join"   // client -> server: token, rank, size, version
	opOK     = "ok"     // server -> client: join accepted
	opGather = "gather" // client -> server: key, value (barriers are gathers of nothing)
	opBye    = "bye"    // client -> server: orderly close
	opResult = "result" // server -> client: key, values indexed by rank
	opError  = "error"  // server -> client: key ("" for join), error, lost rank if any
	opLost   = "lost"   // server -> client, unsolicited: lost rank, reason (only to clients that joined with notify)
)

// frame is the single message type of the protocol, JSON-encoded after a
// 4-byte big-endian length.
type frame struct {
	Op      string   `json:"op"`
	Version int      `json:"version,omitempty"`
	Token   string   `json:"token,omitempty"`
	Rank    int      `json:"rank"`
	Size    int      `json:"size,omitempty"`
	Notify  bool     `json:"notify,omitempty"` // join: the client takes opLost notices
	Key     string   `json:"key,omitempty"`
	Value   []byte   `json:"value,omitempty"`
	Values  [][]byte `json:"values,omitempty"`
	Error   string   `json:"error,omitempty"`
	Lost    *int     `json:"lost,omitempty"` // rank whose disconnection failed the collective, or the lost rank of opLost
}

var errFrameTooLarge = errors.New("frame too large")

// errMalformedFrame is the error of a frame whose payload is not a JSON
// frame object.
var errMalformedFrame = errors.New("malformed frame")

func encodeFrame(f *frame) ([]byte, error) {
	b, err := json.Marshal(f)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxFrameSize {
		return nil, fmt.Errorf("bootstrap: %w: %d bytes > %d", errFrameTooLarge, len(b), MaxFrameSize)
	}
	out := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(out, uint32(len(b)))
	copy(out[4:], b)
	return out, nil
}

// maxJoinFrame bounds the first frame of a connection, its join (under 200
// bytes in practice): the server reads it before it has checked the token,
// so anyone who can reach the port could otherwise make it allocate
// MaxFrameSize per connection.
const maxJoinFrame = 4 << 10

func readFrame(r io.Reader) (*frame, error) { return readFrameMax(r, MaxFrameSize) }

// readFrameMax reads a frame of at most max bytes. It fails with the
// reader's error (io.ErrUnexpectedEOF for a frame cut short), or an error
// wrapping errFrameTooLarge or errMalformedFrame.
func readFrameMax(r io.Reader, max uint32) (*frame, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > max {
		return nil, fmt.Errorf("bootstrap: %w: %d bytes > %d", errFrameTooLarge, n, max)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	f := new(frame)
	if err := json.Unmarshal(buf, f); err != nil {
		return nil, fmt.Errorf("bootstrap: %w: %w", errMalformedFrame, err)
	}
	return f, nil
}
