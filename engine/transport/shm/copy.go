package shm

// streamMin is the size from which the owner's copies stream their stores
// to memory (copyOut, where the platform has it). Below it an ordinary copy
// (through the cache) is faster. Go's own copy streams only from 1 MiB.
const streamMin = 32 << 10
