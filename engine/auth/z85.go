package auth

import (
	"errors"
	"fmt"
)

// Z85 is ZeroMQ's base-85 text form of binary data (ZeroMQ RFC 32): four
// bytes become five characters. Written here rather than called through
// libzmq so that keys are read the same with or without cgo.

const z85Alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"

var z85Value = func() (t [256]int8) {
	for i := range t {
		t[i] = -1
	}
	for i := 0; i < len(z85Alphabet); i++ {
		t[z85Alphabet[i]] = int8(i)
	}
	return t
}()

// Z85Encode returns the Z85 text of b; len(b) must be a multiple of 4
// (keys are 32 bytes), else it panics, as a caller's bug.
func Z85Encode(b []byte) string {
	if len(b)%4 != 0 {
		panic("auth: Z85Encode of a length not a multiple of 4")
	}
	out := make([]byte, 0, len(b)/4*5)
	for i := 0; i < len(b); i += 4 {
		v := uint32(b[i])<<24 | uint32(b[i+1])<<16 | uint32(b[i+2])<<8 | uint32(b[i+3])
		var chunk [5]byte
		for j := 4; j >= 0; j-- {
			chunk[j] = z85Alphabet[v%85]
			v /= 85
		}
		out = append(out, chunk[:]...)
	}
	return string(out)
}

// Z85Decode reads Z85 text; its length must be a multiple of 5.
func Z85Decode(s string) ([]byte, error) {
	if len(s)%5 != 0 {
		return nil, fmt.Errorf("%w: Z85 text of %d characters is not a multiple of 5", ErrBadKey, len(s))
	}
	out := make([]byte, 0, len(s)/5*4)
	for i := 0; i < len(s); i += 5 {
		var v uint64
		for j := 0; j < 5; j++ {
			d := z85Value[s[i+j]]
			if d < 0 {
				return nil, fmt.Errorf("%w: %q is not a Z85 character", ErrBadKey, s[i+j])
			}
			v = v*85 + uint64(d)
		}
		if v > 0xffffffff {
			return nil, errors.Join(ErrBadKey, fmt.Errorf("Z85 group %q overflows 32 bits", s[i:i+5]))
		}
		out = append(out, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	return out, nil
}
