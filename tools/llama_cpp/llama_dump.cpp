// llama-dump: write llama.cpp's intermediate tensors (graph nodes) as .npy, for per-layer
// comparisons with transformers (tools/fixtures/models/deepseek4_investigate.py).
//
// usage:
//   llama-dump -m MODEL.gguf --tokens 1,2,3 --out DIR [--names a-0,b-1,...] [--kv f16|f32]
//              [--fa auto|on|off] [--threads N]
//
// Decodes all tokens in one batch (f32 KV and flash attention off by default) and writes every
// F32 graph node whose name is in --names (all F32 nodes when --names is empty) to
// DIR/<name>.npy with numpy's axis order (the reverse of ggml's ne[]); a node computed more
// than once is written once per evaluation with a ".N" suffix. Built by tools/llama_cpp/build.sh.

#include "ggml-backend.h"
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

static void die(const char * msg) {
    fprintf(stderr, "llama-dump: %s\n", msg);
    exit(1);
}

struct dump_state {
    std::string out;
    std::set<std::string> names;
    std::map<std::string, int> seen;
    std::vector<char> buf;
};

static void write_npy(const std::string & path, const ggml_tensor * t, const void * data) {
    int nd = ggml_n_dims(t);
    std::string shape;
    for (int i = nd - 1; i >= 0; i--) shape += std::to_string(t->ne[i]) + (nd == 1 || i > 0 ? ", " : "");
    std::string hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + shape + "), }";
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
    fwrite(data, sizeof(float), ggml_nelements(t), f);
    fclose(f);
}

static bool cb_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * st = (dump_state *) user_data;
    const std::string name = t->name;
    const bool want = t->type == GGML_TYPE_F32 && (st->names.empty() || st->names.count(name));
    if (ask) return want;
    if (!want) return true;
    const size_t n = ggml_nbytes(t);
    st->buf.resize(n);
    ggml_backend_tensor_get(t, st->buf.data(), 0, n);
    std::vector<float> dense(ggml_nelements(t));
    // gather with strides (views / permutes are not contiguous)
    size_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++)
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                    size_t off = i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                    if (off + sizeof(float) > n) { dense[k++] = 0.0f; continue; }
                    dense[k++] = *(const float *) (st->buf.data() + off);
                }
    int c = st->seen[name]++;
    std::string fname = st->out + "/" + name + (c ? "." + std::to_string(c) : "") + ".npy";
    write_npy(fname, t, dense.data());
    return true;
}

int main(int argc, char ** argv) {
    std::string model_path, tokens_arg, out, names, kv = "f32", fa = "off";
    int n_threads = 2;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string { if (i + 1 >= argc) die("missing argument value"); return argv[++i]; };
        if (a == "-m") model_path = next();
        else if (a == "--tokens") tokens_arg = next();
        else if (a == "--out") out = next();
        else if (a == "--names") names = next();
        else if (a == "--kv") kv = next();
        else if (a == "--fa") fa = next();
        else if (a == "--threads") n_threads = std::stoi(next());
        else die(("unknown argument " + a).c_str());
    }
    if (model_path.empty() || tokens_arg.empty() || out.empty()) die("need -m, --tokens and --out");
    dump_state st;
    st.out = out;
    {
        std::stringstream ss(names);
        std::string s;
        while (std::getline(ss, s, ',')) if (!s.empty()) st.names.insert(s);
    }
    std::vector<llama_token> toks;
    {
        std::stringstream ss(tokens_arg);
        std::string s;
        while (std::getline(ss, s, ',')) toks.push_back(std::stoi(s));
    }

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) die("unable to load model");

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) toks.size() + 16;
    cp.n_batch = cp.n_ubatch = (uint32_t) toks.size();
    cp.n_threads = cp.n_threads_batch = n_threads;
    cp.type_k = cp.type_v = kv == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
    cp.flash_attn_type = fa == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                       : fa == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
    cp.cb_eval = cb_eval;
    cp.cb_eval_user_data = &st;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("unable to create context");

    llama_batch batch = llama_batch_get_one(toks.data(), (int32_t) toks.size());
    if (llama_decode(ctx, batch) != 0) die("decode failed");
    fprintf(stderr, "llama-dump: wrote %zu tensor names to %s\n", st.seen.size(), out.c_str());
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
