/* generate.c: the README's C example (built with the project, so it keeps compiling). */
#include <stdio.h>
#include <tinyloop.h>

int main(void) {
    tl_model *model;
    if (tl_model_load("models/tinyloop-austen", NULL, &model) != TL_OK) {
        fprintf(stderr, "%s\n", tl_last_error());
        return 1;
    }
    int32_t *prompt, out[256];
    int n_prompt, n_out;
    tl_encode(model, "It is a truth", 13, &prompt, &n_prompt);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);          /* the documented defaults */
    cfg.temperature = 0.8f;
    cfg.max_tokens = 100;
    tl_generate_stats stats;
    if (tl_generate(model, prompt, n_prompt, &cfg, out, 256, &n_out, &stats) == TL_OK) {
        char *text;
        tl_decode(model, out, n_out, &text, NULL);
        printf("%s\n[%s, %.1f tok/s]\n", text, tl_stop_reason_name(stats.stop_reason),
               tl_stats_decode_tokens_per_s(&stats));
        tl_free(text);
    }
    tl_free(prompt);
    tl_model_free(model);
}
