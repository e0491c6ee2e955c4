package transport

import (
	"errors"
	"fmt"
)

// Sentinel errors; wrapped errors carry the context (peer, operation, sizes).
var (
	// ErrClosed: the transport was closed before or during the operation.
	ErrClosed = errors.New("transport: closed")
	// ErrInHandler: an active-message handler waited for an operation
	// (Wait, Recv, Probe, WaitAny, Await...) or closed its transport. Handlers run on the
	// goroutine that progresses the worker, one batch at a time: the wait
	// could never end. A handler may start operations and leave the
	// waiting to another goroutine.
	ErrInHandler = errors.New("transport: an active-message handler may not wait for an operation")
	// ErrPeerLost: the peer's process died or became unreachable.
	ErrPeerLost = errors.New("transport: peer lost")
	// ErrTruncated: the receive buffer was smaller than the message.
	ErrTruncated = errors.New("transport: message truncated")
	// ErrOutOfBounds: an RMA access outside the remote region.
	ErrOutOfBounds = errors.New("transport: access out of bounds")
	// ErrInvalid: an argument is out of range.
	ErrInvalid = errors.New("transport: invalid argument")
	// ErrProtocol: a peer sent something troupe's protocol does not allow.
	ErrProtocol = errors.New("transport: protocol error")
	// ErrWithdrawn: the sender of a same-host zero-copy (CMA) message
	// failed its send (it closed its transport, or lost this rank) before
	// this rank read the message. The sender's buffer was its
	// application's again, so what was read is not reported. It also
	// reports a typed (pack protocol) message whose sender failed to pack a
	// chunk: the chunks before it were unpacked into the receive layout,
	// the rest went empty, and the send reports the packing error.
	ErrWithdrawn = errors.New("transport: message withdrawn by its sender")
)

// TruncatedError reports a receive buffer smaller than the message.
type TruncatedError struct {
	Source, Tag int
	Size        int // the message's real size in bytes
	BufLen      int // the receive buffer's size
}

func (e *TruncatedError) Error() string {
	return fmt.Sprintf("transport: message from rank %d tag %d is %d bytes, receive buffer holds %d: truncated", e.Source, e.Tag, e.Size, e.BufLen)
}

// Unwrap makes errors.Is(err, ErrTruncated) true.
func (e *TruncatedError) Unwrap() error { return ErrTruncated }

// PeerLostError names the lost peer and why it was declared lost.
type PeerLostError struct {
	Rank   int
	Op     string
	Reason string
}

func (e *PeerLostError) Error() string {
	return fmt.Sprintf("transport: %s: peer rank %d lost: %s", e.Op, e.Rank, e.Reason)
}

// Unwrap makes errors.Is(err, ErrPeerLost) true.
func (e *PeerLostError) Unwrap() error { return ErrPeerLost }

// BoundsError reports an RMA access outside the remote region.
type BoundsError struct {
	Op             string
	Offset, Length int
	RegionLen      int
}

func (e *BoundsError) Error() string {
	return fmt.Sprintf("transport: %s of %d bytes at offset %d outside remote region of %d bytes", e.Op, e.Length, e.Offset, e.RegionLen)
}

// Unwrap makes errors.Is(err, ErrOutOfBounds) true.
func (e *BoundsError) Unwrap() error { return ErrOutOfBounds }
