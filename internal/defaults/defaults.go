// Package defaults fills the unset fields of an options struct: a field
// that is zero (or, for signed numbers, negative) takes its default, so
// every package's Options treat "not set" alike.
package defaults

// Number is what Fill fills: counts, byte sizes, rates and durations.
type Number interface {
	~int | ~int32 | ~int64 | ~uint32 | ~uint64 | ~float64
}

// Fill sets *v to def unless *v is positive.
func Fill[T Number](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}
