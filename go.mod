module github.com/kvferry/kvferry

go 1.26.0

require (
	github.com/klauspost/compress v1.20.4
	github.com/pebbe/zmq4 v1.4.0
	golang.org/x/crypto v0.59.0
	golang.org/x/sys v0.50.0
)

require github.com/NVIDIA/go-nvml v0.13.4-1
