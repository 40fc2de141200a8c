// llama-logits: measurement tool for moeshard's reference fixtures.
//
// Runs a GGUF model through llama.cpp (CPU) and writes what the fixtures need:
//   * the logits of every prompt position as a float32 .npy [n_tokens, n_vocab],
//   * llama.cpp's own tokenization of a text,
//   * a greedy (argmax) raw continuation.
// Built by tools/llama_cpp/build.sh against the libllama of the same build tree
// (output: $MOESHARD_CACHE/llama.cpp-build/bin/llama-logits).
//
// usage:
//   llama-logits -m MODEL.gguf (--tokens 1,2,3 | --text "some text")
//                [--npy OUT.npy] [--greedy N [--ignore-eog]] [--kv f16|f32] [--fa auto|on|off]
//                [--threads N]
//
// --text is tokenized with llama_tokenize(add_special=true, parse_special=true), i.e. a BOS is
// prepended iff the GGUF says tokenizer.ggml.add_bos_token. --tokens are used verbatim.
// --greedy stops at an end-of-generation token (which is reported) unless --ignore-eog.
// Defaults are llama.cpp's context defaults (f16 KV cache, flash attention "auto").
// A JSON object {"n_vocab": V, "tokens": [...], "pieces": [...], "greedy": [...], "greedy_text": "...",
// "greedy_text_hex": "..."} goes to stdout (greedy_text has U+FFFD for bytes that are not valid
// UTF-8 on their own; greedy_text_hex is exact); llama.cpp's log goes to stderr.

#include "llama.h"

#include <algorithm>
#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void die(const char * msg) {
    fprintf(stderr, "llama-logits: %s\n", msg);
    exit(1);
}

// JSON string body; invalid UTF-8 bytes (a token can end mid-character) become U+FFFD.
static std::string json_escape(const std::string & s) {
    std::string o;
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
        bool ok = len > 0 && i + len <= s.size();
        for (size_t k = 1; ok && k < len; k++) ok = ((unsigned char) s[i + k] >> 6) == 0x2;
        if (!ok) { o += "\\ufffd"; i++; continue; }
        if (len > 1) { o.append(s, i, len); i += len; continue; }
        if (c == '"' || c == '\\') { o += '\\'; o += (char) c; }
        else if (c == '\n') o += "\\n";
        else if (c == '\t') o += "\\t";
        else if (c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); o += b; }
        else o += (char) c;
        i++;
    }
    return o;
}

static std::string hex(const std::string & s) {
    static const char * d = "0123456789abcdef";
    std::string o;
    for (unsigned char c : s) { o += d[c >> 4]; o += d[c & 15]; }
    return o;
}

static void write_npy(const std::string & path, const std::vector<float> & data, size_t rows, size_t cols) {
    std::string hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                      std::to_string(cols) + "), }";
    size_t total = 10 + hdr.size() + 1;
    hdr += std::string((64 - total % 64) % 64, ' ') + "\n";
    FILE * f = fopen(path.c_str(), "wb");
    if (!f) die("cannot open npy output");
    const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    fwrite(magic, 1, 8, f);
    const unsigned short hl = (unsigned short) hdr.size();
    const unsigned char hlb[2] = {(unsigned char) (hl & 0xff), (unsigned char) (hl >> 8)};
    fwrite(hlb, 1, 2, f);
    fwrite(hdr.data(), 1, hdr.size(), f);
    fwrite(data.data(), sizeof(float), data.size(), f);
    fclose(f);
}

static std::string piece(const llama_vocab * vocab, llama_token t) {
    char buf[256];
    int n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, true);
    return n < 0 ? std::string() : std::string(buf, n);
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    std::string model_path, text, tokens_arg, npy_path, kv = "f16", fa = "auto";
    bool have_text = false, ignore_eog = false;
    int n_greedy = 0, n_threads = 0;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string { if (i + 1 >= argc) die("missing argument value"); return argv[++i]; };
        if (a == "-m") model_path = next();
        else if (a == "--text") { text = next(); have_text = true; }
        else if (a == "--tokens") tokens_arg = next();
        else if (a == "--npy") npy_path = next();
        else if (a == "--greedy") n_greedy = std::stoi(next());
        else if (a == "--kv") kv = next();
        else if (a == "--fa") fa = next();
        else if (a == "--ignore-eog") ignore_eog = true;
        else if (a == "--threads") n_threads = std::stoi(next());
        else die(("unknown argument " + a).c_str());
    }
    if (model_path.empty() || (!have_text && tokens_arg.empty())) die("need -m and --text or --tokens");

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) die("unable to load model");
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    std::vector<llama_token> toks;
    if (have_text) {
        int n = -llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), nullptr, 0, true, true);
        toks.resize(n);
        if (llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), toks.data(), n, true, true) < 0) die("tokenize failed");
    } else {
        size_t p = 0;
        while (p < tokens_arg.size()) {
            size_t q = tokens_arg.find(',', p);
            if (q == std::string::npos) q = tokens_arg.size();
            toks.push_back(std::stoi(tokens_arg.substr(p, q - p)));
            p = q + 1;
        }
    }
    const int n_prompt = (int) toks.size();

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_greedy + 1;
    cp.n_batch = cp.n_ubatch = std::max(n_prompt, 1);
    if (n_threads > 0) cp.n_threads = cp.n_threads_batch = n_threads;
    if (kv == "f32") cp.type_k = cp.type_v = GGML_TYPE_F32;
    else if (kv != "f16") die("--kv must be f16 or f32");
    if (fa == "on") cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    else if (fa == "off") cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    else if (fa != "auto") die("--fa must be auto, on or off");
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("unable to create context");

    llama_batch batch = llama_batch_init(n_prompt, 0, 1);
    for (int i = 0; i < n_prompt; i++) {
        batch.token[i] = toks[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;  // output logits for every position
    }
    batch.n_tokens = n_prompt;
    if (llama_decode(ctx, batch) != 0) die("decode failed");

    std::vector<float> all((size_t) n_prompt * n_vocab);
    for (int i = 0; i < n_prompt; i++) {
        const float * l = llama_get_logits_ith(ctx, i);
        std::copy(l, l + n_vocab, all.begin() + (size_t) i * n_vocab);
    }
    if (!npy_path.empty()) write_npy(npy_path, all, n_prompt, n_vocab);

    std::vector<llama_token> gen;
    std::string gen_text;
    const float * last = all.data() + (size_t) (n_prompt - 1) * n_vocab;
    std::vector<float> cur(last, last + n_vocab);
    for (int k = 0; k < n_greedy; k++) {
        llama_token t = (llama_token) (std::max_element(cur.begin(), cur.end()) - cur.begin());
        gen.push_back(t);
        if (!ignore_eog && llama_vocab_is_eog(vocab, t)) break;
        gen_text += piece(vocab, t);
        if (k + 1 == n_greedy) break;
        llama_batch one = llama_batch_get_one(&gen.back(), 1);
        if (llama_decode(ctx, one) != 0) die("decode failed");
        const float * l = llama_get_logits_ith(ctx, -1);
        cur.assign(l, l + n_vocab);
    }

    printf("{\"n_vocab\": %d, \"tokens\": [", n_vocab);
    for (int i = 0; i < n_prompt; i++) printf("%s%d", i ? ", " : "", toks[i]);
    printf("], \"pieces\": [");
    for (int i = 0; i < n_prompt; i++) printf("%s\"%s\"", i ? ", " : "", json_escape(piece(vocab, toks[i])).c_str());
    printf("], \"greedy\": [");
    for (size_t i = 0; i < gen.size(); i++) printf("%s%d", i ? ", " : "", gen[i]);
    printf("], \"greedy_text\": \"%s\", \"greedy_text_hex\": \"%s\"}\n", json_escape(gen_text).c_str(),
           hex(gen_text).c_str());

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
