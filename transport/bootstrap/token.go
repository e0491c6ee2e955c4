package bootstrap

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"strings"
)

// Token is a random 128-bit job token. Only processes that hold it can join
// the job's rendezvous.
type Token [16]byte

// NewToken returns a fresh random token from crypto/rand.
func NewToken() (Token, error) {
	var t Token
	if _, err := rand.Read(t[:]); err != nil {
		return Token{}, fmt.Errorf("bootstrap: generating job token: %w", err)
	}
	return t, nil
}

// ParseToken parses the 32-hex-digit form written by Token.String.
func ParseToken(s string) (Token, error) {
	var t Token
	s = strings.TrimSpace(s)
	if len(s) != 2*len(t) {
		return Token{}, fmt.Errorf("bootstrap: job token must be %d hex digits, got %d characters", 2*len(t), len(s))
	}
	if _, err := hex.Decode(t[:], []byte(s)); err != nil {
		return Token{}, fmt.Errorf("bootstrap: job token is not hex: %w", err)
	}
	return t, nil
}

// String returns the token as 32 lower-case hex digits.
func (t Token) String() string { return hex.EncodeToString(t[:]) }

// IsZero reports whether t is the all-zero token (never produced by NewToken
// in practice, and always rejected by the server).
func (t Token) IsZero() bool { return t == Token{} }

// equal compares in constant time.
func (t Token) equal(o Token) bool { return subtle.ConstantTimeCompare(t[:], o[:]) == 1 }
