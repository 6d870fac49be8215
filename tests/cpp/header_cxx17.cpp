// Compiled, not run: kvferry.h and kvferry.hpp must build as C++17 with
// -Wall -Wextra -Werror -pedantic.
#include "kvferry.h"
#include "kvferry.hpp"

int kvf_header_cxx17_check();

int kvf_header_cxx17_check() {
    kvf_engine_options o;
    kvf_engine_options_init(&o);
    kvferry::Options opts;
    kvf_engine_options c = opts.c();
    kvferry::Segment s;
    kvf_request r = s.write(nullptr, 0, 64, 1);
    kvferry::Error e(KVF_ERR_INVALID, "x");
    return static_cast<int>(o.struct_size + c.struct_size + r.op) + e.code() + (s ? 1 : 0);
}
