/* test_locale.c: the library's text does not follow the host program's locale. A program
 * that calls setlocale(LC_ALL, "") (GUI toolkits, many CLIs) under a locale whose decimal
 * point is a comma had JSON Schema's const/enum numbers written "0,5" in the grammar, which
 * then forced text that is not JSON.
 *
 * usage: test_locale (LOCPATH names a directory holding de_DE.UTF-8, made by localedef: the
 * test's fixture) */
#include <locale.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
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

int main(void) {
    CHECK(setlocale(LC_ALL, "de_DE.UTF-8") != NULL, "setlocale de_DE.UTF-8 (LOCPATH: the fixture's localedef)");
    char shown[16];
    snprintf(shown, sizeof shown, "%g", 0.5);
    CHECK(strcmp(shown, "0,5") == 0, "the locale writes 0.5 as %s (a comma expected: else this test checks nothing)", shown);
    check_schema("{\"enum\": [0.5, 1.25]}", "\"0.5\"", "0,5");
    check_schema("{\"const\": 0.30000000000000004}", "0.30000000000000004", "0,3");
    check_schema("{\"const\": {\"ratio\": 2.5e-7}}", "2.5e-07", "2,5");
    /* the caller's locale is as it was */
    snprintf(shown, sizeof shown, "%g", 0.5);
    CHECK(strcmp(shown, "0,5") == 0, "after the conversion the locale writes 0.5 as %s", shown);
    return check_summary();
}
