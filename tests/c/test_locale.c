/* test_locale.c: the library's text does not follow the host program's locale. A program
 * that calls setlocale(LC_ALL, "") (GUI toolkits, many CLIs) under a locale whose decimal
 * point is a comma had JSON Schema's const/enum numbers written "0,5" in the grammar, which
 * then forced text that is not JSON, and messages read "top_p = 1,5 must be in (0, 1]".
 *
 * And under ps_AF, whose decimal point is two bytes, cJSON refused every fraction.
 *
 * usage: test_locale [DATA_DIR] (LOCPATH names a directory holding de_DE.UTF-8 and
 * ps_AF.UTF-8, made by localedef: the test's fixture) */
#include <locale.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "internal.h" /* tl_config_parse */
#include "tinyloop.h"

static void check_schema(const char *schema, const char *want, const char *refused) {
    char *gbnf = NULL;
    size_t len = 0;
    const tl_status st = tl_json_schema_to_gbnf(schema, strlen(schema), NULL, &gbnf, &len);
    CHECK(st == TL_OK, "%s: %s", schema, tl_last_error());
    if (st != TL_OK) return;
    CHECK(strstr(gbnf, want) != NULL, "%s: the grammar has %s:\n%s", schema, want, gbnf);
    CHECK(strstr(gbnf, refused) == NULL, "%s: the grammar has %s (the locale's decimal point):\n%s", schema, refused, gbnf);
    tl_free(gbnf);
}

/* A refusal's message writes its numbers with a point. */
static void check_message(const tl_model *model, double top_p, const char *want, const char *refused) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.top_p = (float)top_p;
    const int32_t prompt[1] = {1};
    tl_session *session = NULL;
    const tl_status st = tl_session_new(model, prompt, 1, &cfg, &session);
    CHECK(st == TL_ERR_INVALID_ARGUMENT, "top_p %g: %s", top_p, tl_status_name(st));
    CHECK(strstr(tl_last_error(), want) != NULL, "the message has %s: %s", want, tl_last_error());
    CHECK(strstr(tl_last_error(), refused) == NULL, "the message has %s (the locale's decimal point): %s", refused,
          tl_last_error());
    tl_session_free(session);
}

int main(int argc, char **argv) {
    CHECK(setlocale(LC_ALL, "de_DE.UTF-8") != NULL, "setlocale de_DE.UTF-8 (LOCPATH: the fixture's localedef)");
    char shown[16];
    snprintf(shown, sizeof shown, "%g", 0.5);
    CHECK(strcmp(shown, "0,5") == 0, "the locale writes 0.5 as %s (a comma expected: else this test checks nothing)", shown);
    check_schema("{\"enum\": [0.5, 1.25]}", "\"0.5\"", "0,5");
    check_schema("{\"const\": 0.30000000000000004}", "0.30000000000000004", "0,3");
    check_schema("{\"const\": {\"ratio\": 2.5e-7}}", "2.5e-07", "2,5");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/textmodel", argc > 1 ? argv[1] : "tests/data");
    tl_model *model = NULL;
    CHECK(tl_model_load(dir, NULL, &model) == TL_OK, "load %s: %s", dir, tl_last_error());
    if (model) {
        check_message(model, 1.5, "top_p = 1.5 must be", "1,5");
        check_message(model, -0.25, "top_p = -0.25 must be", "0,25");
        tl_model_free(model);
    }
    /* A locale whose decimal point is two bytes (ps_AF's U+066B): cJSON, run in it, refused
       every fraction, and a good config.json (rope_theta 10000.0) read as out of memory. */
    if (setlocale(LC_ALL, "ps_AF.UTF-8") != NULL) {
        CHECK(strlen(localeconv()->decimal_point) > 1, "ps_AF's decimal point is %s", localeconv()->decimal_point);
        static const char config[] =
            "{\"vocab_size\": 320, \"d_model\": 32, \"n_heads\": 4, \"d_ff\": 64, \"max_seq_len\": 128, "
            "\"n_prelude\": 1, \"n_block\": 1, \"n_coda\": 1, \"default_loops\": 2, \"max_loops\": 4, "
            "\"norm\": \"rmsnorm\", \"mlp\": \"swiglu\", \"pos_encoding\": \"rope\", \"bos_token_id\": 319, "
            "\"eos_token_id\": 319, \"injection\": \"add\", \"rope_theta\": 10000.5, \"norm_eps\": 0.00001}";
        tl_config parsed;
        const tl_status st = tl_config_parse(config, &parsed);
        CHECK(st == TL_OK && parsed.rope_theta == 10000.5 && parsed.norm_eps == 0.00001f,
              "a config.json with fractions under ps_AF: %s %s (rope_theta %g)", tl_status_name(st), tl_last_error(),
              st == TL_OK ? parsed.rope_theta : 0.0);
        char *gbnf = NULL;
        size_t len = 0;
        static const char schema[] = "{\"enum\": [0.5]}";
        CHECK(tl_json_schema_to_gbnf(schema, sizeof schema - 1, NULL, &gbnf, &len) == TL_OK && strstr(gbnf, "\"0.5\""),
              "a schema under ps_AF: %s", tl_last_error());
        tl_free(gbnf);
        setlocale(LC_ALL, "de_DE.UTF-8");
    } else {
        CHECK(0, "setlocale ps_AF.UTF-8 (LOCPATH: the fixture's localedef)");
    }
    /* the caller's locale is as it was */
    snprintf(shown, sizeof shown, "%g", 0.5);
    CHECK(strcmp(shown, "0,5") == 0, "after the conversion the locale writes 0.5 as %s", shown);
    return check_summary();
}
