/* Compiled, not run: kvferry.h must build as C99 with -Wall -Wextra -Werror
 * -pedantic, with every declaration usable. */
#include "kvferry.h"

#if KVF_VERSION_NUMBER != KVF_VERSION_MAJOR * 10000 + KVF_VERSION_MINOR * 100 + KVF_VERSION_PATCH
#error "KVF_VERSION_NUMBER"
#endif

int kvf_header_c99_check(void);

int kvf_header_c99_check(void) {
    kvf_engine_options o;
    kvf_engine_options_init(&o);
    kvf_request r = {KVF_OP_WRITE, 0, NULL, NULL, 0, 64, 1};
    kvf_task_status ts = {KVF_TASK_COMPLETED, KVF_OK, 64};
    kvf_stats st;
    kvf_event ev;
    kvf_memory_range mr = {NULL, 0, "cpu"};
    kvf_grant_range gr = {0, 0};
    kvf_abort_result ar;
    kvf_fence_result fr;
    st.struct_size = sizeof st;
    ar.struct_size = sizeof ar;
    fr.struct_size = sizeof fr;
    ev.type = KVF_EVENT_NONE;
    (void)r, (void)ts, (void)mr, (void)gr;
    return (int)o.struct_size + (int)st.struct_size + (int)ar.struct_size + (int)fr.struct_size + (int)ev.type +
           (kvf_status_str(KVF_ERR_INTERNAL) != NULL) + (KVF_TIMEOUT_DEFAULT < 0) + KVF_LOG_OFF +
           (KVF_ERR_UNAUTHENTICATED == KVF_STATUS_MAX) + (KVF_FENCE_RANGES_MAX > 0);
}
