// The KV-Graph encode node's reference images: sockets that grow as they are connected (ComfyUI's Autogrow input
// `images`, none required). Recent frontends show its first socket themselves; older ones (ComfyUI 0.8.0 ships
// frontend 1.35) show none for an input whose sockets are all optional, which would leave a new node nowhere to connect
// its first image. There this adds that first socket; connecting it grows the next one as usual.

import { app } from "../../scripts/app.js";

const NODE_CLASS = "KVGraphTextEncode";
const AUTOGROW_INPUT = "images";
const FIRST_SOCKET = "image1";

app.registerExtension({
  name: "kvgraph.referenceSockets",

  nodeCreated(node) {
    if (node.comfyClass !== NODE_CLASS) return;
    // After the frontend's own set-up and a saved workflow's sockets are in place.
    requestAnimationFrame(() => {
      const prefix = `${AUTOGROW_INPUT}.`;
      if (!node.comfyDynamic?.autogrow?.[AUTOGROW_INPUT]) return; // a frontend without Autogrow: nothing to grow
      if ((node.inputs ?? []).some((input) => input.name.startsWith(prefix))) return;
      node.addInput(`${prefix}${FIRST_SOCKET}`, "IMAGE", { label: FIRST_SOCKET, localized_name: FIRST_SOCKET });
      node.setDirtyCanvas?.(true, true);
    });
  },
});
