# kvferry build and test entry points. `make test` runs everything CI runs.
GO      ?= go
PREFIX  ?= /usr/local
BIN     := bin
# An execution count, not a duration: with a duration Go 1.26's fuzz
# coordinator can fail at the deadline with "context deadline exceeded" and
# no crasher (golang/go#75804, fixed in Go 1.27).
FUZZTIME ?= 100000x
# Fuzzers that open a TCP connection per input run fewer inputs in the same time.
FUZZTIME_NET ?= 20000x
export CGO_ENABLED := 1
# go-nvml's cgo prologue calls functions NVML 13 marks deprecated; its
# warnings are not ours to fix and would bury ours.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

.PHONY: all build deps distclean test test-go test-race test-netfault test-netfault-soak test-cluster vet fmt-check fuzz-short bench run clean

all: build lib

deps:
	@scripts/deps.sh

build: deps
	$(GO) build ./...
	$(GO) build -o $(BIN)/kvferry-bench ./cmd/kvferry-bench
	$(GO) build -o $(BIN)/kvferry ./cmd/kvferry

# The README's main job: a loopback transfer with integrity check and throughput.
run: build
	$(BIN)/kvferry-bench --mode loopback --protocol tcp --op write --block-size 1048576 --threads 4 --duration 5
	$(BIN)/kvferry-bench --mode loopback --protocol tcp --op read --block-size 1048576 --threads 4 --duration 5
	$(BIN)/kvferry-bench --mode loopback --protocol shm --op write --block-size 1048576 --threads 4 --duration 5
	$(BIN)/kvferry-bench --mode loopback --protocol shm --op read --block-size 1048576 --threads 4 --duration 5

test: deps fmt-check vet test-fakeverbs test-fakecuda test-go test-race test-netfault test-cluster fuzz-short test-c test-python test-rxe-ci
	@echo "make test: all passed; soft-RoCE suite: $$(cat build/rxe/status 2>/dev/null || echo 'not run')"

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change: $$out"; exit 1; fi

vet:
	$(GO) vet ./...

# The rdma tests load the fake libibverbs; it is built first so that test
# packages running in parallel find it rather than each building it.
test-go: fakeverbs fakecuda
	$(GO) test -count=1 -timeout 15m ./...

test-race: fakeverbs fakecuda
	$(GO) test -race -short -count=1 -timeout 15m ./...

# The network-fault suite (tests/netfault): random packet loss and
# blackholes through nftables, rate limits through tc tbf, processes paused
# and killed, and a soak of transfers and aborts under all of them. It drops
# packets and shapes lo (in a network namespace of its own where the kernel
# allows one, else on the host's lo, a janitor process removing its rules
# and qdisc however the run ends), and it measures deadlines, so it runs
# alone, after the other Go tests, never beside them (go test ./... skips
# it). Root, nft, tc and ip are needed; without them every test skips and
# says why. About 80 s on 2 cores; test-netfault-soak soaks for 3 minutes.
test-netfault:
	KVFERRY_NETFAULT=1 $(GO) test -count=1 -timeout 10m -v ./tests/netfault/

test-netfault-soak:
	KVFERRY_NETFAULT=1 KVFERRY_NETFAULT_SOAK=3m $(GO) test -count=1 -timeout 10m -v -run '^TestSoak' ./tests/netfault/

# The simulated cluster (tests/cluster): 8 hosts (4 prefill, 4 decode; set
# KVFERRY_CLUSTER_HOSTS to change) as network namespaces on a bridge, etcd
# in one more, all-to-all PD traffic with aborts and fences and every byte
# checked, through a decode host killed and restarted, a link cut, packet
# loss with tc tbf, and etcd killed; it prints a report of each phase. It
# creates namespaces and injects faults (in them only, never on the host's
# interfaces), so it runs alone (go test ./... skips it). Root, ip, nft, tc
# and /usr/bin/etcd are needed. About a minute on 2 cores.
test-cluster:
	KVFERRY_CLUSTER=1 $(GO) test -count=1 -timeout 10m -v ./tests/cluster/

# Each fuzz target for FUZZTIME executions, from its committed seed corpus.
fuzz-short:
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzDecodeEnvelope$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzDecodeDescriptor$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzUnpackBody$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzDecodeAbortMsg$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzDecodeAbortAck$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzDecodeNotification$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzDecodeFenceMsg$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzDecodeFenceAck$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzZMTPReader$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzCurveServerHandshake$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzCurveClientHandshake$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/control -run='^$$' -fuzz='^FuzzCurveMessages$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/transport/tcp -run='^$$' -fuzz='^FuzzHeaderDecode$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/transport/tcp -run='^$$' -fuzz='^FuzzHandshakeOwner$$' -fuzztime=$(FUZZTIME_NET) -fuzzminimizetime=1s
	$(GO) test ./engine/transport/tcp -run='^$$' -fuzz='^FuzzHandshakeInitiator$$' -fuzztime=$(FUZZTIME_NET) -fuzzminimizetime=1s
	$(GO) test ./engine/transport/rdma -run='^$$' -fuzz='^FuzzDecode$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/transport/shm -run='^$$' -fuzz='^FuzzFrameDecode$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/transport/shm -run='^$$' -fuzz='^FuzzOwnerStream$$' -fuzztime=$(FUZZTIME_NET) -fuzzminimizetime=1s
	$(GO) test ./verbs/topo -run='^$$' -fuzz='^FuzzParseFilter$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./cmd/kvferry -run='^$$' -fuzz='^FuzzTopRender$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/metadata -run='^$$' -fuzz='^FuzzDecodeValue$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/metadata -run='^$$' -fuzz='^FuzzParseURL$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s
	$(GO) test ./engine/kvcodec -run='^$$' -fuzz='^FuzzDecode$$' -fuzztime=$(FUZZTIME) -fuzzminimizetime=1s

# Throughput against the raw-tcp baseline of the same run, and Go benchmarks.
bench: build
	scripts/bench.sh
	$(GO) test -run='^$$' -bench=. -benchtime=2s ./engine/...

# The metrics endpoint against the bench's own figures (within 5%), and what
# counting costs on the data path at 64 KiB (on and off in one run).
metrics-check: build
	scripts/metrics-check.sh

# Removes what the build made: the binaries and build/, except build/rxe (the
# soft-RoCE guest's kernel and initramfs, downloaded once; distclean takes it
# too), so that a copied tree's stale CMake cache cannot break make install.
clean:
	rm -rf $(BIN)
	@if [ -d $(BUILD_DIR) ]; then find $(BUILD_DIR) -mindepth 1 -maxdepth 1 ! -name rxe -exec rm -rf {} +; fi

distclean: clean
	rm -rf $(BUILD_DIR)

# C ABI: libkvferry.so, include/kvferry.h(pp), CMake and pkg-config packages,
# built by CMake (which runs go build -buildmode=c-shared) in BUILD_DIR.
BUILD_DIR ?= build
CMAKE     ?= cmake
CMAKE_GEN := $(if $(shell command -v ninja 2>/dev/null),-G Ninja,)
.PHONY: lib install test-c

# build/libkvferry.so (-> .so.0 -> .so.MAJOR.MINOR.PATCH)
lib: deps
	$(CMAKE) -S . -B $(BUILD_DIR) $(CMAKE_GEN) -DCMAKE_INSTALL_PREFIX=$(PREFIX)
	$(CMAKE) --build $(BUILD_DIR) --target kvferry_lib

# make install PREFIX=/opt/kvferry: library, headers, kvferryConfig.cmake, kvferry.pc
install: lib
	$(CMAKE) --install $(BUILD_DIR) --prefix $(PREFIX)

# The C and C++ tests (AddressSanitizer, installed-package consumers) through ctest.
test-c: deps
	$(CMAKE) -S . -B $(BUILD_DIR) $(CMAKE_GEN)
	$(CMAKE) --build $(BUILD_DIR)
	cd $(BUILD_DIR) && ctest --output-on-failure -j2 --timeout 300

# Python binding (bindings/python): the kvferry package, a ctypes binding of
# libkvferry.so and a drop-in mooncake TransferEngine.
PYTHON    ?= python3
PY_DIR    := bindings/python
WHEEL_DIR ?= dist
.PHONY: python test-python wheel wheel-compat test-wheel-compat metrics-check

# Copies the library into the package, so that `pip install bindings/python`
# ships it (cp follows the soname links to the real file).
python: lib
	cp -f $(BUILD_DIR)/libkvferry.so $(PY_DIR)/kvferry/libkvferry.so

# The pytest suite against $(BUILD_DIR)/libkvferry.so; installs pytest if missing.
test-python: lib
	BUILD_DIR=$(BUILD_DIR) PYTHON=$(PYTHON) KVFERRY_LIBRARY=$(abspath $(BUILD_DIR))/libkvferry.so \
	  $(PY_DIR)/scripts/run_tests.sh

# A manylinux wheel in $(WHEEL_DIR) with libzmq and what it needs bundled by
# auditwheel, then proven to load and move data with the system's copies of
# those libraries hidden (in a private mount namespace). Needs PyPI once.
wheel: lib
	PYTHON=$(PYTHON) $(PY_DIR)/scripts/build_wheel.sh $(BUILD_DIR)/libkvferry.so $(WHEEL_DIR) $(BUILD_DIR)/python-wheel
	PYTHON=$(PYTHON) $(PY_DIR)/scripts/check_wheel.sh "$$(ls $(WHEEL_DIR)/kvferry-*.whl)" $(BUILD_DIR)/libkvferry.so $(BUILD_DIR)/python-wheel

# A manylinux_2_28 wheel in $(WHEEL_DIR)/compat (glibc 2.28+: RHEL/Rocky 8
# and 9, Ubuntu 20.04, Debian 10 and newer), whatever this machine's glibc:
# cgo and libzmq (static, from Debian's zeromq3 source package) compiled by
# zig for glibc 2.28, libzmq and libc++ linked into libkvferry.so, the licence
# texts of all of it in kvferry/licenses/; then checked (test-wheel-compat).
# The first run needs PyPI (ziglang) and Debian's source archive, and takes
# 5 to 8 minutes on 2 cores; not part of `make test`.
WHEEL_COMPAT_GLIBC ?= 2.28
wheel-compat: deps
	PYTHON=$(PYTHON) GO=$(GO) CMAKE=$(CMAKE) KVFERRY_GLIBC=$(WHEEL_COMPAT_GLIBC) \
	  $(PY_DIR)/scripts/build_wheel_compat.sh $(WHEEL_DIR)/compat $(BUILD_DIR)/wheel-compat
	$(MAKE) --no-print-directory test-wheel-compat

# Checks the wheel of `make wheel-compat` (its newest GLIBC symbol version,
# its licence texts, auditwheel, a WRITE/READ from a fresh venv); says
# SKIPPED with the reason when no such wheel has been built. Downloads nothing.
test-wheel-compat:
	PYTHON=$(PYTHON) GO=$(GO) KVFERRY_GLIBC=$(WHEEL_COMPAT_GLIBC) KVFERRY_COMPAT_DIR=$(abspath $(WHEEL_DIR)/compat) \
	  $(PY_DIR)/scripts/test_wheel_compat.sh

# Fake libibverbs for CI machines without RDMA hardware (tests/fakeverbs/README.md):
# kvferry loads it through KVFERRY_IBVERBS_LIBRARY=build/fakeverbs/libibverbs.so.1. Its
# soname differs from rdma-core's, so a process that loaded it still finds the
# system's libibverbs under "libibverbs.so.1" (glibc matches loaded sonames).
FAKEVERBS_DIR := build/fakeverbs
FAKEVERBS_LIB := $(FAKEVERBS_DIR)/libibverbs.so.1
.PHONY: fakeverbs test-fakeverbs

fakeverbs: $(FAKEVERBS_LIB)

$(FAKEVERBS_LIB): tests/fakeverbs/fakeverbs.c tests/fakeverbs/libibverbs.map
	@mkdir -p $(@D)
	gcc -O2 -g -fPIC -shared -Wall -Wextra -Werror -pthread -Wl,-soname,libkvferry-fakeverbs.so.1 \
	  -Wl,--version-script=tests/fakeverbs/libibverbs.map -o $@.tmp.$$$$ tests/fakeverbs/fakeverbs.c -lrt && mv -f $@.tmp.$$$$ $@

$(FAKEVERBS_DIR)/selftest: tests/fakeverbs/selftest.c
	@mkdir -p $(@D)
	gcc -O2 -g -Wall -Wextra -Werror -pthread -o $@ $< -ldl

# Two processes, WRITE/READ, errors and flushes, owner fence, SIGSTOP, faults.
test-fakeverbs: $(FAKEVERBS_LIB) $(FAKEVERBS_DIR)/selftest
	$(FAKEVERBS_DIR)/selftest $(FAKEVERBS_LIB)

# Fake libcuda (CUDA driver API) for CI machines without a GPU (tests/fakecuda/README.md):
# kvferry loads it through KVFERRY_CUDA_LIBRARY=build/fakecuda/libcuda.so.1. Its soname
# differs from NVIDIA's, so a process that loaded it still finds a real libcuda.so.1.
FAKECUDA_DIR := build/fakecuda
FAKECUDA_LIB := $(FAKECUDA_DIR)/libcuda.so.1
.PHONY: fakecuda test-fakecuda

fakecuda: $(FAKECUDA_LIB)

$(FAKECUDA_LIB): tests/fakecuda/fakecuda.c
	@mkdir -p $(@D)
	gcc -O2 -g -fPIC -shared -Wall -Wextra -Werror -pthread -fvisibility=hidden -Wl,-soname,libkvferry-fakecuda.so.1 \
	  -o $@.tmp.$$$$ tests/fakecuda/fakecuda.c && mv -f $@.tmp.$$$$ $@

$(FAKECUDA_DIR)/selftest: tests/fakecuda/selftest.c
	@mkdir -p $(@D)
	gcc -O2 -g -Wall -Wextra -Werror -pthread -o $@.tmp.$$$$ $< -ldl && mv -f $@.tmp.$$$$ $@

# Devices, contexts, memory and pointer queries, copies, streams, dma-buf, faults, env (child processes).
test-fakecuda: $(FAKECUDA_LIB) $(FAKECUDA_DIR)/selftest
	$(FAKECUDA_DIR)/selftest $(FAKECUDA_LIB)

# RDMA on a real verbs stack: soft-RoCE (rdma_rxe) in a qemu guest booted on
# Debian's own kernel under software emulation (tests/rxe/README.md). The
# test binaries are built here and run in the guest at their host paths.
# `make test-rxe` runs the full suite; `make test` runs the quick one, which
# says SKIPPED (never passed) where qemu cannot run.
RXE_BIN := build/rxe/bin
.PHONY: deps-rxe rxe-binaries test-rxe test-rxe-ci

# qemu, busybox, rdma-core, perftest (as root, through apt) and Debian's
# kernel package, extracted into build/rxe; exit 77 ("skip") where that
# cannot be done here.
deps-rxe:
	tests/rxe/prepare.sh

rxe-binaries:
	@mkdir -p $(RXE_BIN)
	$(GO) test -c -o $(RXE_BIN)/rdma.test ./engine/transport/rdma
	$(GO) test -c -o $(RXE_BIN)/engine.test ./engine
	$(GO) test -c -o $(RXE_BIN)/pd.test ./tests/pd
	$(GO) test -c -o $(RXE_BIN)/verbs.test ./verbs
	$(GO) build -o $(RXE_BIN)/kvferry-bench ./cmd/kvferry-bench

test-rxe: deps rxe-binaries
	tests/rxe/run.sh full

test-rxe-ci: deps rxe-binaries
	tests/rxe/run.sh quick
