package control

// MaxBuffersForTest exposes the decoder's buffer-count limit to the external
// tests, so they follow it if it changes.
const MaxBuffersForTest = maxBuffers
