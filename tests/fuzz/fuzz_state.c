/* fuzz_state.c: libFuzzer target for reading saved states (tl_session_state_from_bytes) on
 * the small text checkpoint. The input is a state file whose trailing checksum the harness
 * recomputes, so that mutations reach the fields behind it (the checksum alone would refuse
 * almost every mutated input). A state that reads:
 *   - writes back to exactly the bytes it was read from (every field is kept, none
 *     normalised), or, read in an older layout, to bytes that read and write back so;
 *   - resumes, and steps until it stops or 4 tokens, without a crash, leak or UB.
 * A refused one leaves *out NULL and an error message. Seeds: tests/fuzz/corpus/state. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifndef TL_FUZZ_DATA
#define TL_FUZZ_DATA "tests/data"
#endif

static tl_model *model;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!model) {
        tl_load_options o;
        tl_load_options_init(&o);
        o.n_threads = 1;
        if (tl_model_load(TL_FUZZ_DATA "/textmodel", &o, &model) != TL_OK) abort();
    }
    if (size < 8 || size > (1u << 20)) return 0;
    uint8_t *bytes = malloc(size);
    if (!bytes) return 0;
    memcpy(bytes, data, size);
    tl_hasher hash;
    tl_hash_init(&hash);
    tl_hash_add(&hash, bytes, size - 8);
    const uint64_t checksum = tl_hash_final(&hash);
    memcpy(bytes + size - 8, &checksum, 8);

    tl_session_state *state = (tl_session_state *)1;
    tl_status st = tl_session_state_from_bytes(model, bytes, size, &state);
    if (st != TL_OK) {
        if (state != NULL || !tl_last_error()[0]) abort(); /* refused: no state, a message */
        free(bytes);
        return 0;
    }
    /* A state read must write back unchanged; one of an older version (read, no longer
       written) writes as the current version, which must then read and write back unchanged. */
    uint32_t version, written;
    memcpy(&version, bytes + 8, sizeof version);
    void *again = NULL;
    size_t again_len = 0;
    if (tl_session_state_to_bytes(state, &again, &again_len) != TL_OK || again_len < 12) abort();
    memcpy(&written, (const uint8_t *)again + 8, sizeof written);
    if (version != written) {
        tl_session_state *current = NULL;
        void *twice = NULL;
        size_t twice_len = 0;
        if (tl_session_state_from_bytes(model, again, again_len, &current) != TL_OK ||
            tl_session_state_to_bytes(current, &twice, &twice_len) != TL_OK || twice_len != again_len ||
            memcmp(twice, again, again_len) != 0)
            abort();
        tl_free(twice);
        tl_session_state_free(current);
    } else if (again_len != size || memcmp(again, bytes, size) != 0) {
        abort();
    }
    tl_free(again);
    tl_session *s = NULL;
    if (tl_session_resume(model, state, NULL, &s) == TL_OK) {
        int32_t token;
        tl_stop_reason stop = TL_STOP_NONE;
        for (int i = 0; i < 4 && stop == TL_STOP_NONE; i++)
            if (tl_session_step(s, &token, &stop) != TL_OK) break;
    }
    tl_session_free(s);
    tl_session_state_free(state);
    free(bytes);
    return 0;
}
